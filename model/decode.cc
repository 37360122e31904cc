#include "model/decode.h"

#include <torch/torch.h>

#include "kernels/fused_ops.h"
#include "kernels/heads.h"

namespace odyssey::model {

namespace {

// How one pass writes and reads the cache, the same for every layer.
struct CacheStep {
  bool prefill = true;     // true: positions [0, S) of every row; false: one position per row
  torch::Tensor write_at;  // decode: (B,) int64, each row's cache index
  torch::Tensor key_mask;  // decode: (B, 1, 1, T) bool, the entries each row attends to
};

// residual + x @ linear.weight^T (+ bias) (+ a LoRA adapter's term), in the training forward's
// op order (layers.cc).
torch::Tensor Residual(const torch::Tensor& residual, const torch::Tensor& x, const torch::nn::Linear& linear,
                       const LoraAdapter& lora) {
  if (linear->bias.defined()) {
    if (lora) return residual + Project(linear, lora, x);
    return residual + torch::nn::functional::linear(x, linear->weight, linear->bias);
  }
  torch::Tensor y = kernels::AddLinear(residual, x, linear->weight);
  return lora ? y + LoraDelta(lora, x) : y;
}

// DecoderLayerImpl::forward with the attention through the layer's cache.
torch::Tensor LayerForward(const ModelConfig& c, DecoderLayerImpl& layer, const torch::Tensor& h,
                           const LayerContext& ctx, LayerKv& kv, const CacheStep& step) {
  const int64_t B = h.size(0), S = h.size(1);
  const int64_t Hq = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.HeadDim();
  AttentionImpl& attn = *layer.self_attn;
  torch::Tensor x = layer.input_layernorm(h);
  // The session's adapters too (a LoRA session samples from its trained weights).
  torch::Tensor q = Project(attn.q_proj, attn.q_lora, x).view({B, S, Hq, D});   // (B, S, Hq, D)
  torch::Tensor k = Project(attn.k_proj, attn.k_lora, x).view({B, S, Hkv, D});  // (B, S, Hkv, D)
  torch::Tensor v = Project(attn.v_proj, attn.v_lora, x).view({B, S, Hkv, D});
  if (attn.q_norm) {
    q = attn.q_norm(q);
    k = attn.k_norm(k);
  }
  q = ApplyRope(q, ctx.rope).transpose(1, 2);  // (B, Hq, S, D)
  k = ApplyRope(k, ctx.rope).transpose(1, 2);  // (B, Hkv, S, D)
  v = v.transpose(1, 2);
  torch::Tensor out;  // (B, Hq, S, D)
  if (step.prefill) {
    TORCH_CHECK(kv.k.size(2) >= S, "Prefill: the KV cache is shorter than the prompts");
    kv.k.narrow(2, 0, S).copy_(k);
    kv.v.narrow(2, 0, S).copy_(v);
    out = ctx.backend->Forward(q, k, v, ctx.attention);
  } else {
    TORCH_CHECK(S == 1, "Decode: one position per row");
    torch::Tensor at = step.write_at.view({B, 1, 1, 1}).expand({B, Hkv, 1, D});  // (B, Hkv, 1, D)
    kv.k.scatter_(2, at, k);
    kv.v.scatter_(2, at, v);
    // One query per row against its visible entries: the key mask instead of a causal mask.
    out = at::scaled_dot_product_attention(q, kernels::RepeatHeads(kv.k, Hq / Hkv), kernels::RepeatHeads(kv.v, Hq / Hkv),
                                           step.key_mask);
  }
  torch::Tensor heads = out.transpose(1, 2).reshape({B, S, Hq * D});  // (B, S, Hq * D)
  return layer.MlpBlock(Residual(h, heads, attn.o_proj, attn.o_lora));
}

torch::Tensor RunLayers(CausalLMImpl& model, const torch::Tensor& ids, const torch::Tensor& positions, KvCache& cache,
                        const CacheStep& step) {
  torch::Tensor h = model.model->embed_tokens(ids);  // (B, S, hidden)
  LayerContext ctx;
  ctx.rope = MakeRopeTables(RopeInvFreq(model.config(), ids.device()), positions, h.scalar_type());  // (B, S, D)
  ctx.backend = &model.attention_backend();
  TORCH_CHECK(cache.layers.size() == model.model->layer_list.size(), "KV cache of another model");
  for (size_t i = 0; i < cache.layers.size(); ++i) {
    h = LayerForward(model.config(), *model.model->layer_list[i], h, ctx, cache.layers[i], step);
  }
  return model.model->norm(h);
}

}  // namespace

KvCache NewKvCache(CausalLMImpl& model, int64_t B, int64_t T) {
  const ModelConfig& c = model.config();
  const torch::Tensor& w = model.model->embed_tokens->weight;
  const auto opts = torch::TensorOptions().dtype(w.scalar_type()).device(w.device());
  KvCache cache;
  cache.capacity = T;
  for (int64_t i = 0; i < c.num_hidden_layers; ++i) {
    cache.layers.push_back({torch::zeros({B, c.num_key_value_heads, T, c.HeadDim()}, opts),
                            torch::zeros({B, c.num_key_value_heads, T, c.HeadDim()}, opts)});
  }
  return cache;
}

torch::Tensor Prefill(CausalLMImpl& model, const torch::Tensor& ids, KvCache& cache) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) <= cache.capacity, "Prefill: ids must be (B, P) with P <= T");
  torch::NoGradGuard no_grad;
  const int64_t B = ids.size(0), P = ids.size(1);
  torch::Tensor pos =
      torch::arange(P, torch::TensorOptions().dtype(torch::kInt64).device(ids.device())).unsqueeze(0).expand({B, P});
  return RunLayers(model, ids, pos, cache, CacheStep{});
}

torch::Tensor Decode(CausalLMImpl& model, const torch::Tensor& ids, const torch::Tensor& positions, KvCache& cache) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == 1 && positions.dim() == 1 && positions.size(0) == ids.size(0),
              "Decode: ids (B, 1) and positions (B,)");
  torch::NoGradGuard no_grad;
  const int64_t B = ids.size(0), T = cache.capacity;
  CacheStep step;
  step.prefill = false;
  step.write_at = positions;
  torch::Tensor keys = torch::arange(T, positions.options()).unsqueeze(0);  // (1, T)
  step.key_mask = keys.le(positions.unsqueeze(1)).view({B, 1, 1, T});    // (B, 1, 1, T)
  return RunLayers(model, ids, positions.unsqueeze(1), cache, step);
}

}  // namespace odyssey::model
