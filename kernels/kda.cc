#include "kernels/kda.h"

#include <cmath>
#include <vector>

#include <torch/torch.h>

#include "kernels/heads.h"

namespace odyssey::kernels {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kSub = 16;  // the sub-block of KdaDecayedGram (spec 1.5: 16-token sub-blocks)

torch::ScalarType ComputeType(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g) {
  for (const Tensor* t : {&q, &k, &v, &g}) {
    if (t->scalar_type() == torch::kFloat64) return torch::kFloat64;
  }
  return torch::kFloat32;
}

struct Dims {
  int64_t B, H, HV, T, K, V;
};

Dims CheckShapes(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                 const Tensor& h0) {
  TORCH_CHECK(q.dim() == 4 && k.sizes() == q.sizes(), "KDA: q and k must be (B, H, T, K) alike");
  Dims d{q.size(0), q.size(1), v.size(1), q.size(2), q.size(3), v.size(3)};
  TORCH_CHECK(v.dim() == 4 && v.size(0) == d.B && v.size(2) == d.T, "KDA: v must be (B, HV, T, V)");
  TORCH_CHECK(d.HV % d.H == 0, "KDA: HV (", d.HV, ") must be a multiple of H (", d.H, ")");
  TORCH_CHECK(g.sizes() == torch::IntArrayRef({d.B, d.HV, d.T, d.K}), "KDA: g must be (B, HV, T, K)");
  TORCH_CHECK(beta.sizes() == torch::IntArrayRef({d.B, d.HV, d.T}), "KDA: beta must be (B, HV, T)");
  TORCH_CHECK(!h0.defined() || h0.sizes() == torch::IntArrayRef({d.B, d.HV, d.K, d.V}),
              "KDA: h0 must be (B, HV, K, V)");
  return d;
}

double Scale(const KdaOptions& o, int64_t K) { return o.scale > 0 ? o.scale : 1.0 / std::sqrt(double(K)); }

// (B, H, T, K) -> (B, HV, T, K): value head h reads q/k head h / (HV / H). Autograd sums the
// gradients of a group back into its head.
Tensor ExpandHeads(const Tensor& x, int64_t HV) { return RepeatHeads(x, HV / x.size(1)); }

// The chunk-parallel quantities of spec 1.3, every tensor (B, HV, N, C, .) for N chunks of C.
struct Intra {
  Tensor qg;   // (B, HV, N, C, K) scale * q * exp(G)
  Tensor kg;   // (B, HV, N, C, K) k * exp(G_C - G)
  Tensor W;    // (B, HV, N, C, K) T diag(beta) (k * exp(G))
  Tensor U;    // (B, HV, N, C, V) T diag(beta) v
  Tensor Aqk;  // (B, HV, N, C, C) scale * q_i . (k_j * exp(G_i - G_j)), j <= i
  Tensor eGC;  // (B, HV, N, K)    exp(G_C): the chunk's total decay
  Tensor T;    // (B, HV, N, C, C) (I + A_kk)^-1
};

// Pads the length dimension (dim 2) to N * C with zeros and splits it into (N, C).
Tensor Chunk(const Tensor& x, int64_t C) {
  const int64_t T = x.size(2), N = (T + C - 1) / C;
  std::vector<int64_t> pad(2 * (x.dim() - 2), 0);
  pad[pad.size() - 1] = N * C - T;  // constant_pad_nd's pairs run from the last dimension
  Tensor p = N * C == T ? x : at::constant_pad_nd(x, pad, 0.0);
  std::vector<int64_t> shape(p.sizes().begin(), p.sizes().end());
  shape[2] = C;
  shape.insert(shape.begin() + 2, N);
  return p.reshape(shape);
}

// q already scaled and expanded to HV heads; all in the compute dtype. With T_saved (the
// forward's inverse) the backward's graph reuses it: T_saved + (M - M) with M = T (I + A) T has
// T_saved's value exactly and the inverse's derivative dT = -T dA T, so no second forward
// substitution runs.
Intra ComputeIntra(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                   int64_t C, const Tensor& T_saved) {
  Tensor qc = Chunk(q, C), kc = Chunk(k, C), vc = Chunk(v, C);  // (B, HV, N, C, K|V)
  // Padding tokens: g = 0 (no decay), beta = 0 (no write), so the state passes them unchanged.
  Tensor G = Chunk(g, C).cumsum(-2);             // (B, HV, N, C, K) chunk-local, fp32/fp64
  Tensor bc = Chunk(beta, C).unsqueeze(-1);      // (B, HV, N, C, 1)
  Tensor eG = G.exp();                           // <= 1
  Tensor Akk = KdaDecayedGram(kc, kc, G, /*strict=*/true) * bc;  // (B, HV, N, C, C)
  Tensor I = torch::eye(C, Akk.options());
  Intra in;
  if (T_saved.defined()) {
    Tensor M = T_saved.matmul(I + Akk).matmul(T_saved);
    in.T = T_saved + (M.detach() - M);
  } else {
    // (I + A_kk) is unit lower triangular: its inverse by forward substitution (LAPACK's trsm,
    // in the compute dtype). The GPU kernel's 16x16-blocks-then-merge is the same solve.
    in.T = torch::linalg_solve_triangular(I + Akk, I.expand_as(Akk), /*upper=*/false, /*left=*/true,
                                          /*unitriangular=*/true);
  }
  in.W = in.T.matmul(bc * kc * eG);
  in.U = in.T.matmul(bc * vc);
  Tensor GC = G.narrow(-2, C - 1, 1);  // (B, HV, N, 1, K)
  in.kg = kc * (GC - G).exp();         // exponent <= 0
  in.qg = qc * eG;
  in.Aqk = KdaDecayedGram(qc, kc, G, /*strict=*/false);
  in.eGC = GC.squeeze(-2).exp();
  return in;
}

// The inter-chunk scan (spec 1.3 step 3-4) from state h0 (B, HV, K, V). Returns o (B, HV, N*C, V)
// and the final state; with `states`, also each chunk's starting state h_c (the backward's).
std::pair<Tensor, Tensor> Scan(const Intra& in, const Tensor& h0, std::vector<Tensor>* states) {
  const int64_t N = in.W.size(2);
  Tensor S = h0;  // (B, HV, K, V) the fp32/fp64 accumulator
  std::vector<Tensor> os;
  os.reserve(N);
  for (int64_t c = 0; c < N; ++c) {
    if (states != nullptr) states->push_back(S);
    Tensor vt = in.U.select(2, c) - in.W.select(2, c).matmul(S);  // (B, HV, C, V) new values
    os.push_back(in.qg.select(2, c).matmul(S) + in.Aqk.select(2, c).matmul(vt));
    S = in.eGC.select(2, c).unsqueeze(-1) * S + in.kg.select(2, c).transpose(-1, -2).matmul(vt);
  }
  Tensor o = torch::stack(os, 2);  // (B, HV, N, C, V)
  return {o.reshape({o.size(0), o.size(1), -1, o.size(-1)}), S};
}

// Inputs: q (scaled), k, v, g, beta all (B, HV, T, .) in the compute dtype, h0 (B, HV, K, V).
// Saved for backward: those six and T (spec 1.3's list less A_qk, which the backward recomputes
// because its own gradient needs the decayed Gram's graph anyway).
struct KdaChunkFunction : public torch::autograd::Function<KdaChunkFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& g, const Tensor& beta, const Tensor& h0, int64_t C) {
    Intra in = ComputeIntra(q, k, v, g, beta, C, Tensor());
    auto [o, S] = Scan(in, h0, nullptr);
    ctx->save_for_backward({q, k, v, g, beta, h0, in.T});
    ctx->saved_data["C"] = C;
    return {o.narrow(2, 0, q.size(2)).clone(), S};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const int64_t C = ctx->saved_data["C"].toInt();
    variable_list leaves;
    for (int i = 0; i < 5; ++i) leaves.push_back(s[i].detach().requires_grad_(true));
    Intra in;
    {
      torch::AutoGradMode enable(true);
      in = ComputeIntra(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], C, s[6]);
    }
    torch::NoGradGuard no_grad;
    std::vector<Tensor> states;  // per chunk, freed when backward returns
    Scan(in, s[5], &states);
    const int64_t N = in.W.size(2);
    Tensor dO = grads[0].defined() ? Chunk(grads[0], C) : torch::zeros_like(in.U);  // (B, HV, N, C, V)
    Tensor dS = grads[1].defined() ? grads[1].clone() : torch::zeros_like(s[5]);    // (B, HV, K, V)
    Tensor dqg = torch::empty_like(in.qg), dkg = torch::empty_like(in.kg), dW = torch::empty_like(in.W);
    Tensor dU = torch::empty_like(in.U), dAqk = torch::empty_like(in.Aqk), deGC = torch::empty_like(in.eGC);
    // Reverse chunk scan (spec 1.4 step 3): dS is the gradient of the state after chunk c.
    for (int64_t c = N - 1; c >= 0; --c) {
      const Tensor& h = states[c];                                   // (B, HV, K, V)
      Tensor W = in.W.select(2, c), kg = in.kg.select(2, c);          // (B, HV, C, K)
      Tensor vt = in.U.select(2, c) - W.matmul(h);                    // (B, HV, C, V)
      Tensor dOc = dO.select(2, c);                                   // (B, HV, C, V)
      Tensor dvt = in.Aqk.select(2, c).transpose(-1, -2).matmul(dOc) + kg.matmul(dS);
      dAqk.select(2, c).copy_(dOc.matmul(vt.transpose(-1, -2)));
      dqg.select(2, c).copy_(dOc.matmul(h.transpose(-1, -2)));
      dkg.select(2, c).copy_(vt.matmul(dS.transpose(-1, -2)));
      deGC.select(2, c).copy_((h * dS).sum(-1));
      dU.select(2, c).copy_(dvt);
      dW.select(2, c).copy_(-dvt.matmul(h.transpose(-1, -2)));
      dS = in.qg.select(2, c).transpose(-1, -2).matmul(dOc) + in.eGC.select(2, c).unsqueeze(-1) * dS -
           W.transpose(-1, -2).matmul(dvt);
    }
    // WY, inverse, intra-chunk and cumsum backward (spec 1.4 steps 4-6) by autograd of the
    // chunk-parallel graph built above.
    variable_list d = torch::autograd::grad({in.qg, in.kg, in.W, in.U, in.Aqk, in.eGC}, leaves,
                                            {dqg, dkg, dW, dU, dAqk, deGC}, /*retain_graph=*/false,
                                            /*create_graph=*/false, /*allow_unused=*/true);
    return {d[0], d[1], d[2], d[3], d[4], dS, Tensor()};
  }
};

}  // namespace

Tensor KdaDecayedGram(const Tensor& x, const Tensor& y, const Tensor& G, bool strict) {
  const int64_t C = x.size(-2);
  TORCH_CHECK(C % kSub == 0, "KdaDecayedGram: C (", C, ") must be a multiple of ", kSub);
  const int64_t nb = C / kSub;
  Tensor tri = torch::ones({kSub, kSub}, torch::TensorOptions().dtype(torch::kBool).device(x.device()))
                   .tril(strict ? -1 : 0);  // (16, 16) [i, j] kept where j < i (or <=)
  Tensor tri3 = tri.unsqueeze(-1);
  std::vector<Tensor> rows;
  for (int64_t bi = 0; bi < nb; ++bi) {
    const int64_t r0 = bi * kSub;
    Tensor xi = x.narrow(-2, r0, kSub), yi = y.narrow(-2, r0, kSub), Gi = G.narrow(-2, r0, kSub);
    std::vector<Tensor> parts;
    if (bi > 0) {
      // Keys before the block: reference row r0, both exponents <= 0.
      Tensor Gr = G.narrow(-2, r0, 1);                             // (..., 1, K)
      Tensor a = xi * (Gi - Gr).exp();                             // (..., 16, K)
      Tensor b = y.narrow(-2, 0, r0) * (Gr - G.narrow(-2, 0, r0)).exp();  // (..., r0, K)
      parts.push_back(a.matmul(b.transpose(-1, -2)));              // (..., 16, r0)
    }
    // The diagonal block element-wise; the exponent is masked to 0 above the diagonal before exp
    // (it would be positive there), then the product masked to 0.
    Tensor diff = Gi.unsqueeze(-2) - Gi.unsqueeze(-3);  // (..., 16, 16, K) [i, j] = G_i - G_j
    Tensor e = torch::where(tri3, diff, torch::zeros({}, diff.options())).exp() * tri3;
    parts.push_back((xi.unsqueeze(-2) * yi.unsqueeze(-3) * e).sum(-1));  // (..., 16, 16)
    if (bi < nb - 1) {
      std::vector<int64_t> shape(xi.sizes().begin(), xi.sizes().end());
      shape.back() = C - r0 - kSub;
      parts.push_back(torch::zeros(shape, x.options()));
    }
    rows.push_back(torch::cat(parts, -1));
  }
  return torch::cat(rows, -2);
}

std::pair<Tensor, Tensor> KdaNaive(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                   const Tensor& beta, const Tensor& h0, const KdaOptions& options) {
  const Dims d = CheckShapes(q, k, v, g, beta, h0);
  const auto ct = ComputeType(q, k, v, g);
  Tensor qs = ExpandHeads(q.to(ct), d.HV) * Scale(options, d.K), ks = ExpandHeads(k.to(ct), d.HV);
  Tensor vs = v.to(ct), gs = g.to(ct), bs = beta.to(ct);
  Tensor S = h0.defined() ? h0.to(ct) : torch::zeros({d.B, d.HV, d.K, d.V}, vs.options());  // (B, HV, K, V)
  std::vector<Tensor> os;
  os.reserve(d.T);
  for (int64_t t = 0; t < d.T; ++t) {
    Tensor kt = ks.select(2, t), qt = qs.select(2, t);  // (B, HV, K)
    S = S * gs.select(2, t).exp().unsqueeze(-1);
    Tensor kv = (S * kt.unsqueeze(-1)).sum(-2);  // (B, HV, V) S^T k
    S = S + (bs.select(2, t).unsqueeze(-1) * kt).unsqueeze(-1) * (vs.select(2, t) - kv).unsqueeze(-2);
    os.push_back((S * qt.unsqueeze(-1)).sum(-2));  // (B, HV, V)
  }
  return {torch::stack(os, 2).to(v.scalar_type()), S};
}

std::pair<Tensor, Tensor> KdaChunked(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& h0, const KdaOptions& options) {
  const Dims d = CheckShapes(q, k, v, g, beta, h0);
  TORCH_CHECK(options.chunk_size > 0 && options.chunk_size % kSub == 0, "KDA: chunk_size (",
              options.chunk_size, ") must be a positive multiple of ", kSub);
  const auto ct = ComputeType(q, k, v, g);
  Tensor qs = ExpandHeads(q.to(ct), d.HV) * Scale(options, d.K), ks = ExpandHeads(k.to(ct), d.HV);
  Tensor S0 = h0.defined() ? h0.to(ct) : torch::zeros({d.B, d.HV, d.K, d.V}, q.options().dtype(ct));
  variable_list out =
      KdaChunkFunction::apply(qs, ks, v.to(ct), g.to(ct), beta.to(ct), S0, options.chunk_size);
  return {out[0].to(v.scalar_type()), out[1]};
}

}  // namespace odyssey::kernels
