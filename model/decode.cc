#include "model/decode.h"

#include <torch/torch.h>

#include "kernels/dsa.h"
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

// A KDA layer's heads (B, S, H K) for its normed input x: the prompt from a zero state
// (prefill), or the new token after the cached conv context, from the cached state (decode).
torch::Tensor KdaHeads(KdaAttentionImpl& kda, const torch::Tensor& x, LayerKv& kv, const CacheStep& step) {
  const int64_t c = kda.conv_context(), S = x.size(1);
  torch::Tensor out, state;
  if (step.prefill) {
    out = kda.TileHeads(x, 0, torch::Tensor(), &state);
    const int64_t kept = std::min(c, S);
    kv.conv_x.zero_();
    kv.conv_x.narrow(1, c - kept, kept).copy_(x.narrow(1, S - kept, kept));
  } else {
    TORCH_CHECK(S == 1, "Decode: one position per row");
    const torch::Tensor window = torch::cat({kv.conv_x, x}, 1);  // (B, c + 1, hidden)
    out = kda.TileHeads(window, c, kv.state, &state);
    kv.conv_x.copy_(window.narrow(1, 1, c));
  }
  kv.state.copy_(state);
  return out;
}

// A DSA layer's heads (B, S, H D): the training forward on the prompt (prefill), or one query per
// row over its own selection among the complete pools (decode); the cache gains the positions'
// keys, values, indexer keys and gates, and each pool of 4 as it completes.
torch::Tensor DsaHeads(const ModelConfig& c, DsaAttentionImpl& dsa, const torch::Tensor& x, const LayerContext& ctx,
                       LayerKv& kv, const CacheStep& step) {
  const int64_t B = x.size(0), S = x.size(1), H = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.HeadDim();
  const torch::Tensor k = Project(dsa.k_proj, dsa.k_lora, x).view({B, S, Hkv, D}).transpose(1, 2);  // (B, Hkv, S, D)
  const torch::Tensor v = Project(dsa.v_proj, dsa.v_lora, x).view({B, S, Hkv, D}).transpose(1, 2);
  const torch::Tensor ik = dsa.indexer->k_norm(dsa.indexer->wk(x));  // (B, S, DI)
  const torch::Tensor iz = dsa.indexer->pool_gate(x);                // (B, S, DI)
  if (step.prefill) {
    TORCH_CHECK(kv.k.size(2) >= S, "Prefill: the KV cache is shorter than the prompts");
    kv.k.narrow(2, 0, S).copy_(k);
    kv.v.narrow(2, 0, S).copy_(v);
    kv.index_k.narrow(1, 0, S).copy_(ik);
    kv.index_z.narrow(1, 0, S).copy_(iz);
    if (S >= 4) kv.pooled.narrow(1, 0, S / 4).copy_(kernels::KeyPool4(ik, iz, dsa.indexer->pool_bias));
    return dsa.Heads(x, AttentionMeta{}, ctx.backend, nullptr);
  }
  TORCH_CHECK(S == 1, "Decode: one position per row");
  const int64_t kp = c.hybrid.index_top_k / 4;
  const torch::Tensor q = Project(dsa.q_proj, dsa.q_lora, x).view({B, 1, H, D}).transpose(1, 2);  // (B, H, 1, D)
  const torch::Tensor positions = step.write_at.to(torch::kCPU);
  std::vector<torch::Tensor> rows;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t t = positions[b].item<int64_t>();
    kv.k.narrow(0, b, 1).narrow(2, t, 1).copy_(k.narrow(0, b, 1));
    kv.v.narrow(0, b, 1).narrow(2, t, 1).copy_(v.narrow(0, b, 1));
    kv.index_k.narrow(0, b, 1).narrow(1, t, 1).copy_(ik.narrow(0, b, 1));
    kv.index_z.narrow(0, b, 1).narrow(1, t, 1).copy_(iz.narrow(0, b, 1));
    if ((t + 1) % 4 == 0)  // pool t / 4 is complete
      kv.pooled.narrow(0, b, 1).narrow(1, t / 4, 1).copy_(kernels::KeyPool4(
          kv.index_k.narrow(0, b, 1).narrow(1, t - 3, 4), kv.index_z.narrow(0, b, 1).narrow(1, t - 3, 4),
          dsa.indexer->pool_bias));
    const torch::Tensor qb = q.narrow(0, b, 1), kb = kv.k.narrow(0, b, 1), vb = kv.v.narrow(0, b, 1);
    if (c.hybrid.indexer_stage != IndexerStage::kSparse) {
      // The dense warm-up: causal attention over the row's entries [0, t].
      rows.push_back(at::scaled_dot_product_attention(qb, kernels::RepeatHeads(kb.narrow(2, 0, t + 1), H / Hkv),
                                                      kernels::RepeatHeads(vb.narrow(2, 0, t + 1), H / Hkv)));
      continue;
    }
    const int64_t pools = (t + 1) / 4;  // those complete at t: the training forward's visible ones
    torch::Tensor pool = torch::full({1, 1, kp}, -1, x.options().dtype(torch::kInt32));
    if (pools > 0) {
      torch::Tensor iq, iw;
      dsa.indexer->Queries(x.narrow(0, b, 1), &iq, &iw);  // (1, HI, 1, DI), (1, 1, HI)
      kernels::DsaIndexerOptions o;
      o.top_k = kp;
      o.pool = 4;
      o.query_offset = t;
      pool = kernels::IndexerTopK(iq, kv.pooled.narrow(0, b, 1).narrow(1, 0, pools), iw, o);
    }
    rows.push_back(kernels::SparseAttentionForward(qb, kb, vb, kernels::ExpandPoolSelection(pool, t)).out);
  }
  return torch::cat(rows, 0).transpose(1, 2).reshape({B, 1, H * D});  // (B, 1, H D)
}

// DecoderLayerImpl::forward with the attention through the layer's cache.
torch::Tensor LayerForward(const ModelConfig& c, DecoderLayerImpl& layer, const torch::Tensor& h,
                           const LayerContext& ctx, LayerKv& kv, const CacheStep& step) {
  if (layer.kda) {
    const torch::Tensor heads = KdaHeads(*layer.kda, layer.input_layernorm(h), kv, step);
    return layer.MlpBlock(Residual(h, heads, layer.kda->o_proj, layer.kda->o_lora));
  }
  if (layer.dsa) {
    const torch::Tensor heads = DsaHeads(c, *layer.dsa, layer.input_layernorm(h), ctx, kv, step);
    return layer.MlpBlock(Residual(h, heads, layer.dsa->o_proj, layer.dsa->o_lora));
  }
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
  // (B, S, D); the hybrid family is NoPE
  if (model.config().UsesRope())
    ctx.rope = MakeRopeTables(RopeInvFreq(model.config(), ids.device()), positions, h.scalar_type());
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
    LayerKv kv;
    if (c.LayerKind(i) == 'K') {
      const int64_t Hk = c.hybrid.kda_num_heads, K = c.hybrid.kda_head_dim;
      kv.state = torch::zeros({B, Hk, K, K}, opts.dtype(torch::kFloat32));
      kv.conv_x = torch::zeros({B, c.hybrid.kda_conv_kernel - 1, c.hidden_size}, opts);
    } else {
      kv.k = torch::zeros({B, c.num_key_value_heads, T, c.HeadDim()}, opts);
      kv.v = torch::zeros({B, c.num_key_value_heads, T, c.HeadDim()}, opts);
    }
    if (c.LayerKind(i) == 'D') {
      kv.index_k = torch::zeros({B, T, c.hybrid.index_head_dim}, opts);
      kv.index_z = torch::zeros({B, T, c.hybrid.index_head_dim}, opts);
      kv.pooled = torch::zeros({B, T / 4, c.hybrid.index_head_dim}, opts);
    }
    cache.layers.push_back(std::move(kv));
  }
  return cache;
}

namespace {
// Every defined tensor of a layer's cache, in one order.
std::vector<torch::Tensor*> Tensors(LayerKv& kv) {
  std::vector<torch::Tensor*> out;
  for (torch::Tensor* t : {&kv.k, &kv.v, &kv.state, &kv.conv_x, &kv.index_k, &kv.index_z, &kv.pooled})
    if (t->defined()) out.push_back(t);
  return out;
}
}  // namespace

KvCache CacheRows(KvCache& cache, int64_t first, int64_t count) {
  KvCache rows;
  rows.capacity = cache.capacity;
  for (LayerKv& kv : cache.layers) {
    LayerKv view = kv;
    for (torch::Tensor* t : Tensors(view)) *t = t->narrow(0, first, count);
    rows.layers.push_back(std::move(view));
  }
  return rows;
}

void CopyCacheRow(KvCache& cache, int64_t from, int64_t to) {
  for (LayerKv& kv : cache.layers)
    for (torch::Tensor* t : Tensors(kv)) t->narrow(0, to, 1).copy_(t->narrow(0, from, 1));
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
