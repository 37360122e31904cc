#include "model/layers.h"

#include <cmath>

#include <torch/torch.h>

#include "kernels/fused_ops.h"
#include "model/moe.h"

namespace odyssey::model {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

namespace {

// RMSNorm with a hand-written backward (kernels::RmsNormRows: the CUDA kernel, or chunked
// libtorch ops). Plain autograd through the fp32 math would save two fp32 copies of the (S, H)
// activation (8 bytes per element, 24 KB per token for a 3B model); this saves only x itself
// (alive anyway) and the per-row rstd (S fp32). Forward outputs of the reference path stay
// bitwise equal to transformers'.
class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               double eps, int64_t chunk_elements) {
    torch::Tensor rstd;
    torch::Tensor y =
        kernels::RmsNormRows(x.reshape({-1, x.size(-1)}), weight, eps, chunk_elements, &rstd).view(x.sizes());
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["chunk_elements"] = chunk_elements;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor x = saved[0].reshape({-1, saved[0].size(-1)});  // (N, H)
    const torch::Tensor g = grads[0].reshape({-1, x.size(1)});          // (N, H)
    auto [dx, dw] = kernels::RmsNormRowsBackward(g, x, saved[1], saved[2], ctx->saved_data["chunk_elements"].toInt());
    return {dx.view(saved[0].sizes()), dw.to(saved[1].scalar_type()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (torch::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) {
    return RMSNormFunction::apply(x, weight, eps_, chunk_elements_);
  }
  return kernels::RmsNormRows(x.reshape({-1, x.size(-1)}), weight, eps_, chunk_elements_, nullptr).view(x.sizes());
}

torch::Tensor RopeInvFreq(const ModelConfig& config, torch::Device device) {
  const int64_t D = config.HeadDim();
  // Same op order as transformers (fp32 arange / D, then base ** that), so tables match bitwise.
  torch::Tensor exponent = torch::arange(0, D, 2, torch::TensorOptions().dtype(torch::kInt64).device(device))
                               .to(torch::kFloat32) / static_cast<double>(D);
  torch::Tensor inv_freq = 1.0 / torch::pow(c10::Scalar(config.rope_theta), exponent);  // (D/2,)
  if (!config.rope_scaling.enabled) return inv_freq;
  const RopeScaling& r = config.rope_scaling;
  const double old_len = static_cast<double>(r.original_max_position_embeddings);
  const double low_freq_wavelen = old_len / r.low_freq_factor;
  const double high_freq_wavelen = old_len / r.high_freq_factor;
  torch::Tensor wavelen = 2 * M_PI / inv_freq;
  torch::Tensor scaled = torch::where(wavelen > low_freq_wavelen, inv_freq / r.factor, inv_freq);
  torch::Tensor smooth = (old_len / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  torch::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  torch::Tensor medium = (wavelen >= high_freq_wavelen).logical_and(wavelen <= low_freq_wavelen);
  return torch::where(medium, smoothed, scaled);
}

RopeTables MakeRopeTables(const torch::Tensor& inv_freq, const torch::Tensor& position_ids, torch::Dtype dtype) {
  torch::NoGradGuard no_grad;
  torch::Tensor freqs = position_ids.to(torch::kFloat32).unsqueeze(-1) * inv_freq;  // (B, S, D/2)
  torch::Tensor emb = torch::cat({freqs, freqs}, -1);                               // (B, S, D)
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

torch::Tensor ApplyRope(const torch::Tensor& x, const RopeTables& rope) {
  return kernels::Rope(x, rope.cos, rope.sin);  // (B, S, H, D)
}

torch::Tensor LoraDelta(const LoraAdapter& lora, const torch::Tensor& x) {
  // (..., rank) first: never an (in, out) product of the two factors.
  namespace F = torch::nn::functional;
  return F::linear(F::linear(x, lora.A->weight), lora.B->weight) * lora.scale;  // (..., out)
}

torch::Tensor ProjectRows(const torch::nn::Linear& linear, const LoraAdapter& lora, const torch::Tensor& x,
                          int64_t first, int64_t count) {
  namespace F = torch::nn::functional;
  if (first == 0 && count == linear->weight.size(0)) return Project(linear, lora, x);
  TORCH_CHECK(!linear->bias.defined(), "ProjectRows: rows of a projection with a bias");
  torch::Tensor y = F::linear(x, linear->weight.narrow(0, first, count));  // (..., count)
  if (!lora) return y;
  return y + F::linear(F::linear(x, lora.A->weight), lora.B->weight.narrow(0, first, count)) * lora.scale;
}

torch::Tensor Project(const torch::nn::Linear& linear, const LoraAdapter& lora, const torch::Tensor& x) {
  torch::Tensor y = torch::nn::functional::linear(x, linear->weight, linear->bias);  // (..., out): Linear's forward
  if (!lora) return y;
  return y + LoraDelta(lora, x);  // PEFT's order: base output, then the adapter's term
}

namespace {
// residual + x @ linear.weight^T (+ bias) (+ the adapter's term): the add rides the GEMM's
// epilogue where the fused kernels run (see kernels::AddLinear).
torch::Tensor ResidualLinear(const torch::Tensor& residual, const torch::Tensor& x, const torch::nn::Linear& linear,
                             const LoraAdapter& lora) {
  torch::Tensor y;
  // With a bias, transformers' residual + (x W^T + b): the same order, so the CPU stays bitwise equal.
  if (linear->bias.defined()) {
    if (lora) return residual + Project(linear, lora, x);
    y = residual + torch::nn::functional::linear(x, linear->weight, linear->bias);
  } else {
    y = kernels::AddLinear(residual, x, linear->weight);
  }
  return lora ? y + LoraDelta(lora, x) : y;
}
}  // namespace

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : heads_(c.num_attention_heads), kv_heads_(c.num_key_value_heads), head_dim_(c.HeadDim()) {
  const int64_t H = c.hidden_size;
  auto lin = [&](int64_t in, int64_t out, bool bias) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(bias));
  };
  q_proj = register_module("q_proj", lin(H, heads_ * head_dim_, c.QkvBias()));
  k_proj = register_module("k_proj", lin(H, kv_heads_ * head_dim_, c.QkvBias()));
  v_proj = register_module("v_proj", lin(H, kv_heads_ * head_dim_, c.QkvBias()));
  o_proj = register_module("o_proj", lin(heads_ * head_dim_, H, c.OBias()));
  if (c.QkNorm()) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.rms_norm_eps));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.rms_norm_eps));
  }
}

torch::Tensor AttentionImpl::Heads(const torch::Tensor& x, const LayerContext& ctx) {
  const int64_t B = x.size(0), S = x.size(1);
  torch::Tensor q = Project(q_proj, q_lora, x).view({B, S, heads_, head_dim_});     // (B, S, Hq, D)
  torch::Tensor k = Project(k_proj, k_lora, x).view({B, S, kv_heads_, head_dim_});  // (B, S, Hkv, D)
  torch::Tensor v = Project(v_proj, v_lora, x).view({B, S, kv_heads_, head_dim_});
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = ApplyRope(q, ctx.rope).transpose(1, 2);  // (B, Hq, S, D)
  k = ApplyRope(k, ctx.rope).transpose(1, 2);  // (B, Hkv, S, D)
  v = v.transpose(1, 2);
  return ctx.backend->Forward(q, k, v, ctx.attention).transpose(1, 2).reshape({B, S, heads_ * head_dim_});
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const LayerContext& ctx) {
  return Project(o_proj, o_lora, Heads(x, ctx));
}

MlpImpl::MlpImpl(const ModelConfig& c) {
  auto lin = [&](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(c.mlp_bias));
  };
  gate_proj = register_module("gate_proj", lin(c.hidden_size, c.intermediate_size));
  up_proj = register_module("up_proj", lin(c.hidden_size, c.intermediate_size));
  down_proj = register_module("down_proj", lin(c.intermediate_size, c.hidden_size));
}

torch::Tensor MlpImpl::Hidden(const torch::Tensor& x) {
  return kernels::SwiGlu(Project(gate_proj, gate_lora, x), Project(up_proj, up_lora, x));  // (..., intermediate)
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) { return Project(down_proj, down_lora, Hidden(x)); }

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& c, int64_t index) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  switch (c.LayerKind(index)) {
    case 'K': kda = register_module("self_attn", KdaAttention(c)); break;
    case 'D': dsa = register_module("self_attn", DsaAttention(c)); break;
    default: self_attn = register_module("self_attn", Attention(c)); break;
  }
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  if (c.moe.IsMoeLayer(index)) {
    moe = register_module("mlp", std::make_shared<MoeMlpImpl>(c));
  } else {
    mlp = register_module("mlp", Mlp(c));
  }
}

torch::Tensor DecoderLayerImpl::AttentionBlock(const torch::Tensor& h, const LayerContext& ctx) {
  if (kda)
    return ResidualLinear(h, kda->Heads(input_layernorm(h), ctx.attention, ctx.sequence), kda->o_proj, kda->o_lora);
  if (dsa) {
    torch::Tensor indexer_loss;  // set when the indexer trains in this pass
    // The norm goes in with h: in the sparse stage its tiled Function normalizes a tile at a time
    // in backward instead of keeping the norm's output (model/hybrid.h).
    torch::Tensor y = ResidualLinear(
        h, dsa->Heads(h, ctx.attention, ctx.backend, &indexer_loss, ctx.sequence, input_layernorm.get()),
        dsa->o_proj, dsa->o_lora);
    return indexer_loss.defined()
               ? InjectAuxLoss(y, indexer_loss, dsa->indexer_loss_weight() * dsa->gradient_scale())
               : y;
  }
  return ResidualLinear(h, self_attn->Heads(input_layernorm(h), ctx), self_attn->o_proj, self_attn->o_lora);
}

torch::Tensor DecoderLayerImpl::MlpBlock(const torch::Tensor& h) {
  if (moe) return h + moe->forward(post_attention_layernorm(h));  // transformers' residual + moe(norm(h))
  return ResidualLinear(h, mlp->Hidden(post_attention_layernorm(h)), mlp->down_proj, mlp->down_lora);
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& h, const LayerContext& ctx) {
  return MlpBlock(AttentionBlock(h, ctx));
}

}  // namespace odyssey::model
