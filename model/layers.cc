#include "model/layers.h"

#include <cmath>

#include <torch/torch.h>

namespace odyssey::model {

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

namespace {

// Rows per chunk: the norm's fp32 temporaries are a few (rows, H) tensors, so at 1M tokens of
// a 3B model an unchunked norm would allocate 12 GiB per temporary; chunks of ~64M elements
// keep them near 256 MB. Rows are independent, so chunking changes no result.
int64_t NormChunkRows(int64_t H, int64_t chunk_elements) { return std::max<int64_t>(1, chunk_elements / H); }

// y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in transformers' op order, rows
// chunked; rstd (rows, 1) fp32 is written when given.
torch::Tensor NormRows(const torch::Tensor& x2d, const torch::Tensor& weight, double eps, int64_t chunk_elements,
                       torch::Tensor* rstd_out) {
  const int64_t N = x2d.size(0), H = x2d.size(1), chunk = NormChunkRows(H, chunk_elements);
  torch::Tensor y = torch::empty_like(x2d);  // (N, H)
  torch::Tensor rstd = torch::empty({N, 1}, x2d.options().dtype(torch::kFloat32));
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    torch::Tensor xf = x2d.narrow(0, r0, n).to(torch::kFloat32);                            // (n, H)
    torch::Tensor r = torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps);              // (n, 1)
    y.narrow(0, r0, n).copy_(weight * (xf * r).to(x2d.scalar_type()));
    rstd.narrow(0, r0, n).copy_(r);
  }
  if (rstd_out != nullptr) *rstd_out = rstd;
  return y;
}

// RMSNorm with a hand-written backward. Plain autograd through the fp32 math would save two
// fp32 copies of the (S, H) activation (8 bytes per element, 24 KB per token for a 3B model);
// this saves only x itself (alive anyway) and the per-row rstd (S fp32), and recomputes the
// normalized rows chunk by chunk in backward. Forward outputs stay bitwise equal to
// transformers'.
class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor weight,
                               double eps, int64_t chunk_elements) {
    torch::Tensor rstd;
    torch::Tensor y = NormRows(x.reshape({-1, x.size(-1)}), weight, eps, chunk_elements, &rstd).view(x.sizes());
    ctx->save_for_backward({x, weight, rstd});
    ctx->saved_data["chunk_elements"] = chunk_elements;
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const torch::Tensor x = saved[0].reshape({-1, saved[0].size(-1)});  // (N, H)
    const torch::Tensor& weight = saved[1];
    const torch::Tensor& rstd = saved[2];                               // (N, 1)
    const torch::Tensor g = grads[0].reshape({-1, x.size(1)});          // (N, H)
    const int64_t N = x.size(0), chunk = NormChunkRows(x.size(1), ctx->saved_data["chunk_elements"].toInt());
    torch::Tensor dx = torch::empty_like(x);
    torch::Tensor dw = torch::zeros({x.size(1)}, weight.options().dtype(torch::kFloat32));  // (H,)
    for (int64_t r0 = 0; r0 < N; r0 += chunk) {
      const int64_t n = std::min(chunk, N - r0);
      torch::Tensor r = rstd.narrow(0, r0, n);
      torch::Tensor gc = g.narrow(0, r0, n);
      torch::Tensor nrm = x.narrow(0, r0, n).to(torch::kFloat32) * r;   // (n, H) fp32
      torch::Tensor dn = (gc * weight).to(torch::kFloat32);              // through the cast
      dx.narrow(0, r0, n).copy_(r * (dn - nrm * (dn * nrm).mean(-1, /*keepdim=*/true)));
      dw.add_((gc.to(torch::kFloat32) * nrm.to(x.scalar_type()).to(torch::kFloat32)).sum(0));
    }
    return {dx.view(saved[0].sizes()), dw.to(weight.scalar_type()), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (torch::GradMode::is_enabled() && (x.requires_grad() || weight.requires_grad())) {
    return RMSNormFunction::apply(x, weight, eps_, chunk_elements_);
  }
  return NormRows(x.reshape({-1, x.size(-1)}), weight, eps_, chunk_elements_, nullptr).view(x.sizes());
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

namespace {
torch::Tensor RotateHalf(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}
}  // namespace

torch::Tensor ApplyRope(const torch::Tensor& x, const RopeTables& rope) {
  torch::Tensor cos = rope.cos.unsqueeze(1);  // (B, 1, S, D)
  torch::Tensor sin = rope.sin.unsqueeze(1);
  return x * cos + RotateHalf(x) * sin;  // (B, H, S, D)
}

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

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const LayerContext& ctx) {
  const int64_t B = x.size(0), S = x.size(1);
  torch::Tensor q = q_proj(x).view({B, S, heads_, head_dim_});     // (B, S, Hq, D)
  torch::Tensor k = k_proj(x).view({B, S, kv_heads_, head_dim_});  // (B, S, Hkv, D)
  torch::Tensor v = v_proj(x).view({B, S, kv_heads_, head_dim_});
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = ApplyRope(q.transpose(1, 2), ctx.rope);  // (B, Hq, S, D)
  k = ApplyRope(k.transpose(1, 2), ctx.rope);  // (B, Hkv, S, D)
  v = v.transpose(1, 2);
  torch::Tensor o = ctx.backend->Forward(q, k, v, ctx.attention);  // (B, Hq, S, D)
  return o_proj(o.transpose(1, 2).reshape({B, S, heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const ModelConfig& c) {
  auto lin = [&](int64_t in, int64_t out) {
    return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(c.mlp_bias));
  };
  gate_proj = register_module("gate_proj", lin(c.hidden_size, c.intermediate_size));
  up_proj = register_module("up_proj", lin(c.hidden_size, c.intermediate_size));
  down_proj = register_module("down_proj", lin(c.intermediate_size, c.hidden_size));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));  // via (..., intermediate)
}

DecoderLayerImpl::DecoderLayerImpl(const ModelConfig& c) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  self_attn = register_module("self_attn", Attention(c));
  post_attention_layernorm = register_module("post_attention_layernorm", RMSNorm(c.hidden_size, c.rms_norm_eps));
  mlp = register_module("mlp", Mlp(c));
}

torch::Tensor DecoderLayerImpl::AttentionBlock(const torch::Tensor& h, const LayerContext& ctx) {
  return h + self_attn(input_layernorm(h), ctx);
}

torch::Tensor DecoderLayerImpl::MlpBlock(const torch::Tensor& h) { return h + mlp(post_attention_layernorm(h)); }

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& h, const LayerContext& ctx) {
  return MlpBlock(AttentionBlock(h, ctx));
}

}  // namespace odyssey::model
