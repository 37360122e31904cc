// The model's side of the attention seam. Every attention layer (AttentionImpl in layers.h:
// projections, q/k norm, RoPE) calls one kernels::AttentionBackend, so kernels (ATen SDPA,
// cuDNN, head-grouped, context-parallel, sparse) slot in without touching the layer math.
// The backends and their contract (shapes, causality, packed rows) live in kernels/attention.h;
// the model's API (CausalLMImpl::set_attention_backend, LayerContext) names them through these
// declarations; callers that pick a backend call kernels:: (MakeAttentionBackend, WrapHeadGroups).
#pragma once

#include "kernels/attention.h"

namespace odyssey::model {

using kernels::AttentionBackend;
using kernels::AttentionMeta;

}  // namespace odyssey::model
