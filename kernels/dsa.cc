#include "kernels/dsa.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <ATen/record_function.h>
#include <torch/torch.h>

#ifdef ODYSSEY_KERNELS_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/dsa_indexer.h"
#include "kernels/cuda/indexer_kl.h"
#include "kernels/cuda/sparse_attention.h"
#include "kernels/cuda/warmup_target.h"
#endif
#include "kernels/fused_ops.h"
#include "kernels/heads.h"

namespace odyssey::kernels {
namespace {

using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr double kInf = std::numeric_limits<double>::infinity();

torch::ScalarType ComputeType(std::initializer_list<const Tensor*> ts) {
  for (const Tensor* t : ts) {
    if (t->scalar_type() == torch::kFloat64) return torch::kFloat64;
  }
  return torch::kFloat32;
}

void CheckIndexer(const Tensor& q, const Tensor& k, const Tensor& w, const DsaIndexerOptions& o) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 3 && w.dim() == 3, "DSA indexer: q (B, HI, n, D), k (B, P, D), w (B, n, HI)");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(3), "DSA indexer: k must be (B, P, D) with q's B, D");
  TORCH_CHECK(w.size(0) == q.size(0) && w.size(1) == q.size(2) && w.size(2) == q.size(1),
              "DSA indexer: w must be (B, n, HI) with q's B, n and HI");
  TORCH_CHECK(o.top_k >= 1 && o.pool >= 1 && o.query_block >= 1 && o.key_block >= 1 && o.workspace_bytes >= 1,
              "DSA indexer: top_k, pool, query_block, key_block and workspace_bytes must be >= 1");
  TORCH_CHECK(o.query_offset >= 0, "DSA indexer: query_offset (", o.query_offset, ") must be >= 0");
}

// (Sq, P) true where item p (of those from `first`) is visible to query t (of those from `t0`).
Tensor Visible(int64_t t0, int64_t Sq, int64_t first, int64_t P, int64_t pool, const torch::Device& dev) {
  auto lo = torch::TensorOptions().dtype(torch::kLong).device(dev);
  Tensor t = torch::arange(t0, t0 + Sq, lo).unsqueeze(1);
  Tensor last_token = torch::arange(first, first + P, lo).unsqueeze(0) * pool + (pool - 1);
  return last_token <= t;
}

// The selection rule of the file comment over candidates already in index order among equal
// scores: a stable descending sort keeps the lower index first. Returns the first `k` (values,
// item indices).
std::pair<Tensor, Tensor> TopKStable(const Tensor& vals, const Tensor& items, int64_t k) {
  auto [sv, si] = torch::sort(vals, /*stable=*/true, /*dim=*/-1, /*descending=*/true);
  return {sv.narrow(-1, 0, k), items.gather(-1, si.narrow(-1, 0, k))};
}

// Gathers rows of x (B, Hk, S, D) at idx (B, Sq, W) (int64, clamped valid): (B, Hk, Sq, W, D).
// x_flat is x as (B * S, Hk, D), made once per call.
Tensor GatherKeys(const Tensor& x_flat, const Tensor& idx, int64_t S) {
  const int64_t B = idx.size(0), Sq = idx.size(1), W = idx.size(2);
  Tensor base = torch::arange(B, idx.options()).view({B, 1, 1}) * S;
  Tensor g = x_flat.index_select(0, (idx + base).reshape(-1));  // (B * Sq * W, Hk, D)
  return g.view({B, Sq, W, x_flat.size(1), x_flat.size(2)}).permute({0, 3, 1, 2, 4});
}

Tensor FlatRows(const Tensor& x) {  // (B, Hk, S, D) -> (B * S, Hk, D)
  return x.permute({0, 2, 1, 3}).reshape({x.size(0) * x.size(2), x.size(1), x.size(3)});
}

// One query block's probabilities: s (B, Hkv, n, G, W) scaled scores, masked; lse (B, Hkv, n, G).
struct BlockProbs {
  Tensor ks, vs, p, lse;
};

BlockProbs Probs(const Tensor& qb /* (B, Hkv, n, G, D) */, const Tensor& k_flat, const Tensor& v_flat,
                 const Tensor& idx /* (B, n, W) int32 */, int64_t Sk, double scale, const Tensor& lse_saved) {
  Tensor il = idx.to(torch::kLong);
  Tensor valid = (il >= 0).unsqueeze(1).unsqueeze(3);  // (B, 1, n, 1, W)
  Tensor ic = il.clamp_min(0);
  BlockProbs r;
  r.ks = GatherKeys(k_flat, ic, Sk);  // (B, Hkv, n, W, D)
  r.vs = GatherKeys(v_flat, ic, Sk);  // (B, Hkv, n, W, Dv)
  Tensor s = qb.matmul(r.ks.transpose(-1, -2)).mul_(scale).masked_fill_(valid.logical_not(), -kInf);
  r.lse = lse_saved.defined() ? lse_saved : torch::logsumexp(s, -1);  // -inf for a row with no key
  Tensor lse_safe = torch::where(torch::isinf(r.lse), torch::zeros({}, r.lse.options()), r.lse);
  r.p = (s - lse_safe.unsqueeze(-1)).exp();  // masked entries: exp(-inf) = 0
  return r;
}

struct Dims {
  int64_t B, H, Hkv, G, Sq, Sk, D, Dv, W;
};
Dims DimsOf(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& idx) {
  return {q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2), q.size(3), v.size(3),
          idx.size(2)};
}

double ResolveScale(double scale, const Tensor& q) { return scale > 0 ? scale : 1.0 / std::sqrt(double(q.size(3))); }

// The libtorch path: inputs in any dtype, computed in the compute dtype; heads as (B, Hkv, n, G, .)
// so a block's gathered keys serve its G query heads. lse (B, H, Sq) in the compute dtype.
SparseAttentionResult ForwardLibtorch(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& idx,
                                      double scale, int64_t qblock) {
  const auto ct = ComputeType({&q_in, &k_in, &v_in});
  const Tensor q = q_in.to(ct), k = k_in.to(ct), v = v_in.to(ct);
  const Dims d = DimsOf(q, k, v, idx);
  Tensor k_flat = FlatRows(k), v_flat = FlatRows(v);
  Tensor o = torch::empty({d.B, d.Hkv, d.Sq, d.G, d.Dv}, v.options());  // head h = h' G + g
  Tensor lse = torch::empty({d.B, d.Hkv, d.Sq, d.G}, v.options());
  Tensor q5 = q.reshape({d.B, d.Hkv, d.G, d.Sq, d.D}).transpose(2, 3);  // (B, Hkv, Sq, G, D)
  for (int64_t t0 = 0; t0 < d.Sq; t0 += qblock) {
    const int64_t n = std::min(qblock, d.Sq - t0);
    BlockProbs r = Probs(q5.narrow(2, t0, n), k_flat, v_flat, idx.narrow(1, t0, n), d.Sk, scale, Tensor());
    o.narrow(2, t0, n).copy_(r.p.matmul(r.vs));  // (B, Hkv, n, G, Dv)
    lse.narrow(2, t0, n).copy_(r.lse);
  }
  return {o.transpose(2, 3).reshape({d.B, d.H, d.Sq, d.Dv}).to(q_in.scalar_type()),
          lse.permute({0, 1, 3, 2}).reshape({d.B, d.H, d.Sq})};
}

// dO . o as sum_j p_j (dO . v_j) from the block's probabilities (as the CUDA path does), so the
// backward needs no forward output.
Tensor BackwardLibtorch(const Tensor& dO_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                        const Tensor& idx, const Tensor& lse_in, double scale, int64_t qblock, Tensor& dk_acc,
                        Tensor& dv_acc) {
  const auto ct = ComputeType({&q_in, &k_in, &v_in});
  const Tensor q = q_in.to(ct), k = k_in.to(ct), v = v_in.to(ct);
  const Dims d = DimsOf(q, k, v, idx);
  Tensor k_flat = FlatRows(k), v_flat = FlatRows(v);
  Tensor q5 = q.reshape({d.B, d.Hkv, d.G, d.Sq, d.D}).transpose(2, 3);                         // (B, Hkv, Sq, G, D)
  Tensor dO = dO_in.to(ct).reshape({d.B, d.Hkv, d.G, d.Sq, d.Dv}).transpose(2, 3);            // (B, Hkv, Sq, G, Dv)
  Tensor lse = lse_in.to(ct).reshape({d.B, d.Hkv, d.G, d.Sq}).transpose(2, 3);                // (B, Hkv, Sq, G)
  Tensor dq = torch::empty({d.B, d.Hkv, d.Sq, d.G, d.D}, q.options());
  Tensor dk_rows = dk_acc.view({-1, d.D}), dv_rows = dv_acc.view({-1, d.Dv});  // (B * Hkv * Sk, D|Dv)
  auto lo = idx.options().dtype(torch::kLong);
  Tensor head_base = torch::arange(d.B * d.Hkv, lo).view({d.B, d.Hkv, 1, 1}) * d.Sk;  // first row of (b, h')
  for (int64_t t0 = 0; t0 < d.Sq; t0 += qblock) {
    const int64_t n = std::min(qblock, d.Sq - t0);
    Tensor qb = q5.narrow(2, t0, n), idxb = idx.narrow(1, t0, n);
    BlockProbs r = Probs(qb, k_flat, v_flat, idxb, d.Sk, scale, lse.narrow(2, t0, n));
    Tensor dOb = dO.narrow(2, t0, n);                                       // (B, Hkv, n, G, Dv)
    Tensor dp = dOb.matmul(r.vs.transpose(-1, -2));                         // (B, Hkv, n, G, W)
    Tensor ds = r.p * (dp - (r.p * dp).sum(-1, /*keepdim=*/true)) * scale;  // the sum: dO . o
    dq.narrow(2, t0, n).copy_(ds.matmul(r.ks));                             // (B, Hkv, n, G, D)
    Tensor dks = ds.transpose(-1, -2).matmul(qb);                           // (B, Hkv, n, W, D), summed over G
    Tensor dvs = r.p.transpose(-1, -2).matmul(dOb);                         // (B, Hkv, n, W, Dv)
    // Invalid slots point at key 0 with p = 0: they add exact zeros there.
    Tensor rows = (idxb.to(torch::kLong).clamp_min(0).unsqueeze(1) + head_base).reshape(-1);  // (B, Hkv, n, W)
    dk_rows.index_add_(0, rows, dks.reshape({-1, d.D}));
    dv_rows.index_add_(0, rows, dvs.reshape({-1, d.Dv}));
  }
  return dq.transpose(2, 3).reshape({d.B, d.H, d.Sq, d.D}).to(q_in.scalar_type());
}

#ifdef ODYSSEY_KERNELS_CUDA
// The CUDA path (kernels/cuda/sparse_attention.h): q, k, v in fp32 or bf16 alike, head dims 64
// or 128, computed in fp32 without upcasting the inputs.
bool SparseKernel(const Tensor& q, const Tensor& k, const Tensor& v) {
  const auto t = q.scalar_type();
  return FusedKernelsEnabled() && q.is_cuda() && (t == torch::kFloat32 || t == torch::kBFloat16) &&
         k.scalar_type() == t && v.scalar_type() == t && cuda::SparseAttentionSupported(q.size(3), v.size(3)) &&
         q.size(0) <= 65535 && q.size(1) <= 65535 && q.size(0) * q.size(2) < std::numeric_limits<int32_t>::max();
}

// x as the kernels read it: the last dim contiguous, rows 16-byte aligned (the pointer and every
// other stride a multiple of 16 bytes), else a contiguous copy.
Tensor Rows(const Tensor& x) {
  const int64_t align = 16 / static_cast<int64_t>(x.element_size());
  auto ok = [&](const Tensor& t) {
    bool aligned = t.stride(-1) == 1 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int64_t d = 0; d + 1 < t.dim(); ++d) aligned = aligned && t.stride(d) % align == 0;
    return aligned;
  };
  if (ok(x)) return x;
  Tensor c = x.contiguous();
  return ok(c) ? c : c.clone();
}
cuda::SparseRows In(const Tensor& x) { return {x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)}; }
cuda::SparseOutRows Out(const Tensor& x) { return {x.data_ptr(), x.stride(0), x.stride(1), x.stride(2)}; }
void* Stream(const Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// S: q's rows (those of idx, lse, o); Sk: k's and v's.
cuda::SparseAttentionArgs KernelArgs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& idx,
                                     double scale) {
  return {q.scalar_type() == torch::kBFloat16, In(q), In(k), In(v), idx.data_ptr<int32_t>(), q.size(0), q.size(1),
          k.size(1), q.size(2), k.size(2), idx.size(2), q.size(3), v.size(3), static_cast<float>(scale)};
}

SparseAttentionResult ForwardKernels(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& idx_in,
                                     double scale) {
  c10::cuda::CUDAGuard guard(q_in.device());
  Tensor q = Rows(q_in), k = Rows(k_in), v = Rows(v_in), idx = idx_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Dv = v.size(3);
  Tensor o = torch::empty({B, Sq, H, Dv}, v.options()).permute({0, 2, 1, 3});  // (B, H, Sq, Dv) view
  Tensor lse = torch::empty({B, H, Sq}, q.options().dtype(torch::kFloat32));
  CheckKernelLaunch(cuda::SparseAttentionForward(KernelArgs(q, k, v, idx, scale), Out(o), lse.data_ptr<float>(),
                                                 Stream(q)),
                    "sparse attention forward");
  return {o, lse};
}

// The key side groups the selection into units (a query's run of entries in one aligned block of
// 4 keys: a selected pool) and sorts them by block, a segment of queries at a time (at most
// `pairs` entries per segment; a stable sort: each block's units in increasing order,
// deterministic sums), and adds dk, dv into the fp32 accumulators.
Tensor BackwardKernels(const Tensor& dO_in, const Tensor& q_in, const Tensor& k_in, const Tensor& v_in,
                       const Tensor& idx_in, const Tensor& lse_in, double scale, int64_t pairs, Tensor& dk_acc,
                       Tensor& dv_acc) {
  c10::cuda::CUDAGuard guard(q_in.device());
  Tensor q = Rows(q_in), k = Rows(k_in), v = Rows(v_in), idx = idx_in.contiguous(), lse = lse_in.contiguous();
  const int64_t B = q.size(0), H = q.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3), W = idx.size(2);
  Tensor dO = Rows(dO_in.to(q.scalar_type()));
  const cuda::SparseAttentionArgs a = KernelArgs(q, k, v, idx, scale);
  Tensor dq = torch::empty({B, Sq, H, D}, q.options()).permute({0, 2, 1, 3});
  Tensor delta = torch::empty({B, H, Sq}, lse.options());
  CheckKernelLaunch(cuda::SparseAttentionBackwardQuery(a, In(dO), lse.data_ptr<float>(), Out(dq),
                                                       delta.data_ptr<float>(), Stream(q)),
                    "sparse attention backward (queries)");
  constexpr int64_t kb = cuda::kSparseKeyBlock;
  const int64_t nb = (Sk + kb - 1) / kb;  // aligned blocks of kb keys
  const Tensor block_grid = torch::arange(B * nb + 1, idx.options().dtype(torch::kLong));
  const Tensor batch_base = torch::arange(B, idx.options()).view({B, 1, 1}) * static_cast<int32_t>(nb);
  // Rows per segment: at most `pairs` entries (and int32 entry numbers) at a time.
  const int64_t seg = std::max<int64_t>(1, pairs / std::max<int64_t>(W * B, 1));
  for (int64_t t0 = 0; t0 < Sq && W > 0; t0 += seg) {
    const int64_t n = std::min(seg, Sq - t0);
    Tensor part = idx.narrow(1, t0, n);  // (B, n, W)
    const int64_t key_end = part.max().item<int32_t>() + 1;
    if (key_end <= 0) continue;  // no valid index in the segment
    // A unit starts where the entry before is not a smaller key of the same block.
    Tensor prev = torch::cat({torch::full({B, n, 1}, -1, part.options()), part.narrow(2, 0, W - 1)}, 2);
    Tensor block = part.div(kb, "floor");
    Tensor head = (part >= 0).logical_and_(block.ne(prev.div(kb, "floor")).logical_or_(part.le(prev)));
    Tensor first = head.reshape(-1).nonzero().squeeze(1);  // int64 entry numbers, increasing
    Tensor unit_block = (block + batch_base).reshape(-1).index_select(0, first);
    auto [sorted, order] = torch::sort(unit_block, /*stable=*/true, /*dim=*/0, /*descending=*/false);
    Tensor unit_first = first.index_select(0, order).to(torch::kInt32);
    Tensor offsets = torch::searchsorted(sorted, block_grid);  // int64 (B * nb + 1)
    const cuda::SparseKeyUnits units{offsets.data_ptr<int64_t>(), unit_first.data_ptr<int32_t>(), t0, n};
    CheckKernelLaunch(cuda::SparseAttentionBackwardKeys(a, In(dO), lse.data_ptr<float>(), delta.data_ptr<float>(),
                                                        units, (key_end + kb - 1) / kb, dk_acc.data_ptr<float>(),
                                                        dv_acc.data_ptr<float>(), Stream(q)),
                      "sparse attention backward (keys)");
  }
  return dq;
}
#endif

// The one dispatch of the forward and the backward: the CUDA kernels where SparseKernel says, else
// libtorch. scale resolved; inputs checked.
SparseAttentionResult ForwardImpl(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& idx, double scale,
                                  int64_t qblock) {
  torch::NoGradGuard no_grad;
#ifdef ODYSSEY_KERNELS_CUDA
  if (SparseKernel(q, k, v)) return ForwardKernels(q, k, v, idx, scale);
#endif
  return ForwardLibtorch(q, k, v, idx, scale, qblock);
}

Tensor BackwardImpl(const Tensor& dO, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& idx,
                    const Tensor& lse, double scale, int64_t qblock, int64_t pairs, Tensor& dk_acc, Tensor& dv_acc) {
  torch::NoGradGuard no_grad;
#ifdef ODYSSEY_KERNELS_CUDA
  if (SparseKernel(q, k, v)) return BackwardKernels(dO, q, k, v, idx, lse, scale, pairs, dk_acc, dv_acc);
#endif
  (void)pairs;
  return BackwardLibtorch(dO, q, k, v, idx, lse, scale, qblock, dk_acc, dv_acc);
}

// Saved: q, k, v (as given), the indices and the log-sum-exp; the key gradients summed into
// accumulators of the compute dtype, returned in k's and v's dtypes.
struct SparseAttentionFunction : public torch::autograd::Function<SparseAttentionFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& idx, double scale, int64_t qblock, int64_t pairs) {
    SparseAttentionResult r = ForwardImpl(q, k, v, idx, scale, qblock);
    ctx->save_for_backward({q, k, v, idx, r.lse});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["qblock"] = qblock;
    ctx->saved_data["pairs"] = pairs;
    return {r.out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &idx = s[3], &lse = s[4];
    auto acc = k.options().dtype(lse.scalar_type());
    Tensor dk = torch::zeros(k.sizes(), acc), dv = torch::zeros(v.sizes(), acc);
    Tensor dq = BackwardImpl(grads[0], q, k, v, idx, lse, ctx->saved_data["scale"].toDouble(),
                             ctx->saved_data["qblock"].toInt(), ctx->saved_data["pairs"].toInt(), dk, dv);
    return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type()), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

// Shapes, query_block and the indices' range (one reduction over them, a device sync).

// One pass over the indices (and one device sync): every entry in [-1, Sk), or the kernels would
// read outside k and v. `what` names the tensor and the bound (IndexerKlLoss: pool_idx, P).
void CheckIndexRange(const char* fn, const Tensor& indices, int64_t Sk,
                     const char* what = "indices must lie in [-1, Sk) (Sk = ", const char* rows = ", k's rows)") {
  if (indices.numel() == 0) return;
  auto [lo, hi] = torch::aminmax(indices);
  TORCH_CHECK(lo.item<int32_t>() >= -1 && hi.item<int32_t>() < Sk, fn, ": ", what, Sk, rows);
}
void CheckSparseAttention(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                          int64_t query_block) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn, ": q, k, v must be 4-d");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(3) == q.size(3), fn, ": k must be (B, Hkv, Sk, D) with q's B (",
              q.size(0), ") and D (", q.size(3), "), got ", k.sizes());
  TORCH_CHECK(v.size(0) == q.size(0) && v.size(1) == k.size(1) && v.size(2) == k.size(2), fn,
              ": v must be (B, Hkv, Sk, Dv) with k's B, Hkv and Sk (", k.sizes(), "), got ", v.sizes());
  TORCH_CHECK(q.size(1) % k.size(1) == 0, fn, ": Hkv (", k.size(1), ") must divide H (", q.size(1), ")");
  TORCH_CHECK(indices.dim() == 3 && indices.scalar_type() == torch::kInt32 && indices.size(0) == q.size(0) &&
                  indices.size(1) == q.size(2),
              fn, ": indices must be (B, Sq, W) int32 with q's B (", q.size(0), ") and Sq (", q.size(2), "), got ",
              indices.sizes(), " ", indices.scalar_type());
  TORCH_CHECK(query_block >= 1, fn, ": query_block must be >= 1");
  CheckIndexRange(fn, indices, k.size(2));
}

void CheckBackwardPairs(const char* fn, int64_t backward_pairs) {
  TORCH_CHECK(backward_pairs >= 1 && backward_pairs <= std::numeric_limits<int32_t>::max(), fn,
              ": backward_pairs must be in [1, 2^31 - 1] (the key side numbers its entries in int32)");
}

}  // namespace

Tensor IndexerScores(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w) {
  const auto ct = ComputeType({&q_idx, &k_idx, &w});
  Tensor qk = q_idx.to(ct).matmul(k_idx.to(ct).unsqueeze(1).transpose(-1, -2)).relu_();  // (B, HI, Sq, P)
  Tensor wt = w.to(ct).permute({0, 2, 1}).unsqueeze(-1);                                  // (B, HI, Sq, 1)
  return (qk * wt).sum(1) / std::sqrt(double(q_idx.size(3)));                             // (B, Sq, P)
}

Tensor IndexerTopKNaive(const Tensor& q, const Tensor& k, const Tensor& w, const DsaIndexerOptions& o) {
  CheckIndexer(q, k, w, o);
  const int64_t B = q.size(0), S = q.size(2), P = k.size(1);
  Tensor scores =
      IndexerScores(q, k, w).masked_fill(Visible(o.query_offset, S, 0, P, o.pool, q.device()).logical_not(), -kInf);
  // Pad to at least top_k columns with -inf items of index -1 (after every real item, so they
  // never displace one).
  const int64_t width = std::max(P, o.top_k);
  Tensor vals = at::constant_pad_nd(scores, {0, width - P}, -kInf);  // (B, S, width)
  Tensor items = at::constant_pad_nd(torch::arange(P, q.options().dtype(torch::kLong)), {0, width - P}, -1)
                     .expand({B, S, width});
  auto [tv, ti] = TopKStable(vals, items, o.top_k);
  return torch::where(torch::isinf(tv), torch::full({}, -1, ti.options()), ti).to(torch::kInt32);
}

#ifdef ODYSSEY_KERNELS_CUDA
namespace {

bool IndexerKernel(const Tensor& q, const Tensor& k, const DsaIndexerOptions& o) {
  return FusedKernelsEnabled() && q.is_cuda() && k.is_cuda() && q.scalar_type() == torch::kBFloat16 &&
         k.scalar_type() == torch::kBFloat16 && cuda::IndexerSelectSupported(q.size(3), q.size(1), o.top_k) &&
         q.size(2) < std::numeric_limits<int32_t>::max() && k.size(1) < std::numeric_limits<int32_t>::max() &&
         q.size(2) > 0;
}

int64_t RoundUp(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Query chunks [t0, t0 + rows) of the positions [begin, end) whose scores (rows x ld fp32, ld the
// chunk's visible items rounded up to the item tile) fit in `floats`, at least 64 rows (the score
// block's queries). Absolute positions: a tile late in the sequence sees more items a row.
struct IndexerPlan {
  struct Chunk {
    int64_t t0, rows, ld;
  };
  std::vector<Chunk> chunks;
  int64_t max_floats = 0;
};
IndexerPlan PlanIndexerChunks(int64_t begin, int64_t end, int64_t P, int64_t pool, int64_t floats) {
  IndexerPlan plan;
  auto ld_of = [&](int64_t t0, int64_t rows) {
    return RoundUp(std::min(P, (t0 + rows) / pool), cuda::kIndexerItemTile);
  };
  for (int64_t t0 = begin; t0 < end;) {
    int64_t rows = end - t0;
    // At most 65535 score blocks of 64 queries (the grid's y limit).
    rows = std::min(rows, int64_t{65535} * 64);
    for (int it = 0; it < 3 && rows * ld_of(t0, rows) > floats; ++it) {
      rows = std::max<int64_t>(64, floats / std::max<int64_t>(1, ld_of(t0, rows)) / 64 * 64);
      rows = std::min(rows, end - t0);
    }
    const int64_t ld = ld_of(t0, rows);
    plan.chunks.push_back({t0, rows, ld});
    plan.max_floats = std::max(plan.max_floats, rows * ld);
    t0 += rows;
  }
  return plan;
}

Tensor IndexerTopKCuda(const Tensor& q_in, const Tensor& k_in, const Tensor& w, const DsaIndexerOptions& o) {
  const c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = Rows(q_in), k = Rows(k_in);
  const Tensor wf = w.to(torch::kFloat32).contiguous();  // (B, n, HI)
  const int64_t B = q.size(0), HI = q.size(1), n = q.size(2), D = q.size(3), P = k.size(1);
  Tensor out = torch::empty({B, n, o.top_k}, q.options().dtype(torch::kInt32));
  const IndexerPlan plan =
      PlanIndexerChunks(o.query_offset, o.query_offset + n, P, o.pool, std::max<int64_t>(1, o.workspace_bytes / 4));
  Tensor ws = torch::empty({std::max<int64_t>(1, plan.max_floats)}, q.options().dtype(torch::kFloat32));
  for (int64_t b = 0; b < B; ++b) {
    for (const IndexerPlan::Chunk& ch : plan.chunks) {
      cuda::IndexerChunk c;
      c.q = static_cast<const at::BFloat16*>(q.data_ptr()) + b * q.stride(0);
      c.q_sh = q.stride(1);
      c.q_ss = q.stride(2);
      c.k = static_cast<const at::BFloat16*>(k.data_ptr()) + b * k.stride(0);
      c.k_ss = k.stride(1);
      c.w = wf.data_ptr<float>() + b * n * HI;
      c.S = n, c.P = P, c.D = D, c.HI = HI, c.pool = o.pool, c.top_k = o.top_k;
      c.q0 = o.query_offset;
      c.t0 = ch.t0, c.rows = ch.rows, c.ld = ch.ld;
      c.scores = ws.data_ptr<float>();
      c.out = out.data_ptr<int32_t>() + b * n * o.top_k;
      CheckKernelLaunch(cuda::IndexerScores(c, Stream(q)), "DSA indexer scores");
      CheckKernelLaunch(cuda::IndexerSelect(c, Stream(q)), "DSA indexer selection");
    }
  }
  return out;
}

}  // namespace
#endif

Tensor IndexerTopK(const Tensor& q, const Tensor& k, const Tensor& w, const DsaIndexerOptions& o) {
  CheckIndexer(q, k, w, o);
#ifdef ODYSSEY_KERNELS_CUDA
  if (IndexerKernel(q, k, o)) return IndexerTopKCuda(q, k, w, o);
#endif
  const int64_t B = q.size(0), S = q.size(2), P = k.size(1);
  const auto ct = ComputeType({&q, &k, &w});
  auto lo = q.options().dtype(torch::kLong);
  Tensor out = torch::empty({B, S, o.top_k}, q.options().dtype(torch::kInt32));
  for (int64_t t0 = 0; t0 < S; t0 += o.query_block) {
    const int64_t Sq = std::min(o.query_block, S - t0);
    Tensor qb = q.narrow(2, t0, Sq), wb = w.narrow(1, t0, Sq);
    // Running top-k: starts as k empty slots (-inf, -1), which sort before nothing real.
    Tensor run_v = torch::full({B, Sq, o.top_k}, -kInf, q.options().dtype(ct));
    Tensor run_i = torch::full({B, Sq, o.top_k}, -1, lo);
    // Items the block's last query (position t + Sq - 1) sees: pool p + pool - 1 <= t + Sq - 1.
    const int64_t t = o.query_offset + t0;
    const int64_t n_items = std::min(P, (t + Sq) / o.pool);
    for (int64_t p0 = 0; p0 < n_items; p0 += o.key_block) {
      const int64_t Pk = std::min(o.key_block, n_items - p0);
      Tensor sc = IndexerScores(qb, k.narrow(1, p0, Pk), wb)
                      .masked_fill_(Visible(t, Sq, p0, Pk, o.pool, q.device()).logical_not(), -kInf);
      // Earlier blocks' survivors first: every one has a lower index than this block's items,
      // and among themselves they are in the rule's order, so the stable sort keeps the rule.
      std::tie(run_v, run_i) = TopKStable(torch::cat({run_v, sc}, -1),
                                          torch::cat({run_i, torch::arange(p0, p0 + Pk, lo).expand({B, Sq, Pk})}, -1),
                                          o.top_k);
    }
    out.narrow(1, t0, Sq).copy_(torch::where(torch::isinf(run_v), torch::full({}, -1, lo), run_i));
  }
  return out;
}

Tensor KeyPool4(const Tensor& k, const Tensor& z, const Tensor& bias) {
  TORCH_CHECK(k.dim() == 3 && z.sizes() == k.sizes(), "KeyPool4: k and z must be (B, S, D) alike");
  TORCH_CHECK(bias.dim() == 2 && bias.size(0) == 4 && bias.size(1) == k.size(2), "KeyPool4: bias must be (4, D)");
  const int64_t B = k.size(0), P = k.size(1) / 4, D = k.size(2);
  const auto ct = ComputeType({&k, &z, &bias});
  Tensor kk = k.narrow(1, 0, 4 * P).to(ct).view({B, P, 4, D});
  Tensor zz = z.narrow(1, 0, 4 * P).to(ct).view({B, P, 4, D}) + bias.to(ct);
  return (torch::softmax(zz, 2) * kk).sum(2).to(k.scalar_type());  // (B, P, D)
}

namespace {

// Rows t0 .. t0 + n - 1 of ExpandPoolSelection, pool_idx (B, n, kp) those rows' selections:
// (B, n, 4 kp + 3) int32, through int64 transients of those rows only.
Tensor ExpandPoolRows(const Tensor& pool_idx, int64_t t0) {
  const int64_t B = pool_idx.size(0), S = pool_idx.size(1), kp = pool_idx.size(2);
  auto lo = pool_idx.options().dtype(torch::kLong);
  Tensor p = pool_idx.to(torch::kLong).unsqueeze(-1);                                 // (B, S, kp, 1)
  Tensor tok = torch::where(p >= 0, p * 4 + torch::arange(4, lo), torch::full({}, -1, lo)).view({B, S, 4 * kp});
  Tensor out = torch::cat({tok, torch::full({B, S, 3}, -1, lo)}, -1);  // (B, S, 4 kp + 3)
  Tensor t = torch::arange(t0, t0 + S, lo).view({1, S, 1});
  Tensor n_valid = (pool_idx >= 0).sum(-1, /*keepdim=*/true).to(torch::kLong) * 4;  // (B, S, 1)
  Tensor tail = (t + 1).div(4, "floor") * 4 + torch::arange(3, lo);                  // (1, S, 3)
  out.scatter_(-1, (n_valid + torch::arange(3, lo)).expand({B, S, 3}),
               torch::where(tail <= t, tail, torch::full({}, -1, lo)).expand({B, S, 3}));
  return out.to(torch::kInt32);
}

}  // namespace

Tensor ExpandPoolSelection(const Tensor& pool_idx, int64_t t0) {
  TORCH_CHECK(pool_idx.dim() == 3 && pool_idx.scalar_type() == torch::kInt32,
              "ExpandPoolSelection: pool_idx must be (B, n, kp) int32");
  TORCH_CHECK(t0 >= 0, "ExpandPoolSelection: t0 (", t0, ") must be >= 0");
  const int64_t B = pool_idx.size(0), n = pool_idx.size(1), kp = pool_idx.size(2);
  // Rows in blocks: the int64 transients (~6 of (rows, 4 kp) int64) are a block's, not the
  // sequence's (at 1M tokens and 512 pools the whole-sequence transients were ~50 GB).
  constexpr int64_t kRows = 16384;
  if (n <= kRows) return ExpandPoolRows(pool_idx, t0);
  Tensor out = torch::empty({B, n, 4 * kp + 3}, pool_idx.options());
  for (int64_t r0 = 0; r0 < n; r0 += kRows) {
    const int64_t rows = std::min(kRows, n - r0);
    out.narrow(1, r0, rows).copy_(ExpandPoolRows(pool_idx.narrow(1, r0, rows), t0 + r0));
  }
  return out;
}

Tensor SparseAttentionProbs(const Tensor& q, const Tensor& k, const Tensor& indices, double scale,
                            int64_t query_block, const Tensor& lse) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.size(0) == q.size(0) && k.size(3) == q.size(3),
              "SparseAttentionProbs: q (B, H, Sq, D), k (B, Hkv, Sk, D)");
  TORCH_CHECK(q.size(1) % k.size(1) == 0, "SparseAttentionProbs: Hkv (", k.size(1), ") must divide H (", q.size(1),
              ")");
  TORCH_CHECK(indices.dim() == 3 && indices.scalar_type() == torch::kInt32 && indices.size(0) == q.size(0) &&
                  indices.size(1) == q.size(2),
              "SparseAttentionProbs: indices must be (B, Sq, W) int32");
  TORCH_CHECK(query_block >= 1, "SparseAttentionProbs: query_block must be >= 1");
  CheckIndexRange("SparseAttentionProbs", indices, k.size(2));
  const auto ct = ComputeType({&q, &k});
  TORCH_CHECK(!lse.defined() || (lse.dim() == 3 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                                 lse.size(2) == q.size(2) && lse.scalar_type() == ct),
              "SparseAttentionProbs: lse must be (B, H, Sq) = (", q.size(0), ", ", q.size(1), ", ", q.size(2), ") ",
              c10::toString(ct));
  torch::NoGradGuard no_grad;
  const double sc = scale > 0 ? scale : 1.0 / std::sqrt(double(q.size(3)));
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3),
                W = indices.size(2), G = H / Hkv;
#ifdef ODYSSEY_KERNELS_CUDA
  if (SparseKernel(q, k, k)) {
    c10::cuda::CUDAGuard guard(q.device());
    Tensor qr = Rows(q), kr = Rows(k), idx = indices.contiguous(), lr = lse.defined() ? lse.contiguous() : Tensor();
    Tensor probs = torch::empty({B, Sq, W}, q.options().dtype(torch::kFloat32));
    CheckKernelLaunch(cuda::SparseAttentionProbs(KernelArgs(qr, kr, kr, idx, sc),
                                                 lr.defined() ? lr.data_ptr<float>() : nullptr,
                                                 probs.data_ptr<float>(), Stream(qr)),
                      "sparse attention probabilities");
    return probs;
  }
#endif
  Tensor out = torch::empty({B, Sq, W}, q.options().dtype(ct));
  const Tensor k_flat = FlatRows(k.to(ct));  // (B * Sk, Hkv, D)
  for (int64_t t0 = 0; t0 < Sq; t0 += query_block) {
    const int64_t n = std::min(query_block, Sq - t0);
    Tensor il = indices.narrow(1, t0, n).to(torch::kLong);                             // (B, n, W)
    Tensor ks = GatherKeys(k_flat, il.clamp_min(0), Sk);                               // (B, Hkv, n, W, D)
    Tensor qb = q.narrow(2, t0, n).to(ct).view({B, Hkv, G, n, D}).permute({0, 1, 3, 2, 4});  // (B, Hkv, n, G, D)
    Tensor s = torch::matmul(qb, ks.transpose(-1, -2)) * sc;                           // (B, Hkv, n, G, W)
    s = s.masked_fill((il < 0).view({B, 1, n, 1, W}), -kInf);
    Tensor p;
    if (lse.defined()) {
      Tensor l = lse.narrow(2, t0, n).view({B, Hkv, G, n}).permute({0, 1, 3, 2}).unsqueeze(-1);  // (B, Hkv, n, G, 1)
      p = (s - l).exp().nan_to_num(0.0);  // rows without a key (-inf - -inf): 0
    } else {
      p = torch::softmax(s, -1).nan_to_num(0.0);  // rows without a key: 0
    }
    out.narrow(1, t0, n).copy_(p.sum({1, 3}) / static_cast<double>(H));
  }
  return out;
}

Tensor MaskedLogSoftmax(const Tensor& logits, const Tensor& valid) {
  Tensor row_has = valid.any(-1, /*keepdim=*/true);
  Tensor masked = torch::where(row_has, logits.masked_fill(valid.logical_not(), -kInf),
                               torch::zeros({}, logits.options()));
  return torch::log_softmax(masked, -1);
}

Tensor KlSum(const Tensor& target, const Tensor& logp) {
  return torch::where(target > 0, target * (target.clamp_min(1e-30).log() - logp), torch::zeros({}, logp.options()))
      .sum();
}

namespace {

// One block of rows of the KL loss, recomputed from the inputs: the selected pools' keys, the
// per-head dot products, the scores and the log-softmax over the valid selected pools.
struct KlBlock {
  Tensor qi, wi, ksel, dots, valid, pic, logp, target;
};
KlBlock KlRows(const Tensor& q, const Tensor& k, const Tensor& w, const Tensor& pool_idx, const Tensor& target,
               int64_t t0, int64_t n, torch::ScalarType ct) {
  const int64_t B = q.size(0), P = k.size(1), DI = q.size(3), kp = pool_idx.size(2);
  KlBlock r;
  r.qi = q.narrow(2, t0, n).to(ct);  // (B, HI, n, DI)
  r.wi = w.narrow(1, t0, n).to(ct);  // (B, n, HI)
  Tensor pi = pool_idx.narrow(1, t0, n).to(torch::kLong);  // (B, n, kp)
  r.valid = pi >= 0;
  r.pic = pi.clamp_min(0) + torch::arange(B, pi.options()).view({B, 1, 1}) * P;  // rows of k as (B * P, DI)
  // Gathered in the keys' dtype, then converted: only the block's rows, never all of k.
  r.ksel = k.reshape({B * P, DI}).index_select(0, r.pic.reshape(-1)).to(ct).view({B, n, kp, DI});
  r.dots = torch::einsum("bhqd,bqpd->bhqp", {r.qi, r.ksel});  // (B, HI, n, kp)
  Tensor logits = (r.dots.relu() * r.wi.permute({0, 2, 1}).unsqueeze(-1)).sum(1) / std::sqrt(double(DI));
  r.logp = MaskedLogSoftmax(logits, r.valid);
  r.target = target.narrow(1, t0, n).to(ct).masked_fill(r.valid.logical_not(), 0.0);
  return r;
}

#ifdef ODYSSEY_KERNELS_CUDA
// The CUDA path of IndexerKlLoss (kernels/cuda/indexer_kl.h): bf16 q, k, w on a GPU, the head
// counts and widths the kernels take, while FusedKernelsEnabled().
bool IndexerKlKernel(const Tensor& q, const Tensor& k, const Tensor& w) {
  const auto bf = torch::kBFloat16;
  return FusedKernelsEnabled() && q.is_cuda() && q.scalar_type() == bf && k.scalar_type() == bf &&
         w.scalar_type() == bf && cuda::IndexerKlSupported(q.size(1), q.size(3)) && q.size(0) <= 65535;
}

// The kernels' view of the inputs: q and k with 16-byte aligned rows, the rest contiguous (the
// tensors returned in `keep` must outlive the launch).
cuda::IndexerKlArgs KlArgs(const Tensor& q, const Tensor& k, const Tensor& w, const Tensor& pool_idx,
                           const Tensor& target, std::vector<Tensor>& keep) {
  keep = {Rows(q), Rows(k), w.contiguous(), pool_idx.contiguous(), target.to(torch::kFloat32).contiguous()};
  const Tensor &qr = keep[0], &kr = keep[1];
  return {qr.data_ptr(), qr.stride(0), qr.stride(1), qr.stride(2), kr.data_ptr(), kr.stride(0), kr.stride(1),
          keep[2].data_ptr(), keep[3].data_ptr<int32_t>(), keep[4].data_ptr<float>(), q.size(0), q.size(1),
          q.size(2), k.size(1), q.size(3), pool_idx.size(2)};
}
#endif

struct IndexerKlFunction : public torch::autograd::Function<IndexerKlFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& w,
                               const Tensor& pool_idx, const Tensor& target, int64_t block) {
    const auto ct = ComputeType({&q, &k, &w});
    ctx->save_for_backward({q, k, w, pool_idx, target});
    ctx->saved_data["block"] = block;
#ifdef ODYSSEY_KERNELS_CUDA
    if (IndexerKlKernel(q, k, w)) {
      c10::cuda::CUDAGuard guard(q.device());
      std::vector<Tensor> keep;
      const cuda::IndexerKlArgs a = KlArgs(q, k, w, pool_idx, target, keep);
      Tensor rows = torch::empty({q.size(0), q.size(2)}, q.options().dtype(torch::kFloat32));
      CheckKernelLaunch(cuda::IndexerKlForward(a, rows.data_ptr<float>(), Stream(q)), "indexer KL forward");
      return {rows.sum().to(ct)};
    }
#endif
    Tensor total = torch::zeros({}, q.options().dtype(ct));
    for (int64_t t0 = 0; t0 < q.size(2); t0 += block) {
      const KlBlock r = KlRows(q, k, w, pool_idx, target, t0, std::min(block, q.size(2) - t0), ct);
      total += KlSum(r.target, r.logp);
    }
    return {total};
  }

  // d KL / d logits = p * (sum of the row's target) - target on the valid entries; then through
  // logits = sum_j w_j relu(dots_j) / sqrt(DI) and dots_j = q_j . k[pool] by hand.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list sv = ctx->get_saved_variables();
    const Tensor &q = sv[0], &k = sv[1], &w = sv[2], &pool_idx = sv[3], &target = sv[4];
    const int64_t block = ctx->saved_data["block"].toInt();
    const auto ct = ComputeType({&q, &k, &w});
    const int64_t B = q.size(0), P = k.size(1), DI = q.size(3), kp = pool_idx.size(2);
    const double inv_sqrt = 1.0 / std::sqrt(double(DI));
    const Tensor g = grads[0].to(ct);
#ifdef ODYSSEY_KERNELS_CUDA
    if (IndexerKlKernel(q, k, w)) {
      c10::cuda::CUDAGuard guard(q.device());
      std::vector<Tensor> keep;
      const cuda::IndexerKlArgs a = KlArgs(q, k, w, pool_idx, target, keep);
      Tensor dq = torch::empty(q.sizes(), q.options());  // contiguous (B, HI, S, DI)
      Tensor dw = torch::empty(w.sizes(), w.options());
      Tensor dk = torch::zeros({B, P, DI}, k.options().dtype(torch::kFloat32));
      const Tensor gd = g.to(q.device(), torch::kFloat32).contiguous();
      CheckKernelLaunch(cuda::IndexerKlBackward(a, gd.data_ptr<float>(), dq.data_ptr(), dw.data_ptr(),
                                                dk.data_ptr<float>(), Stream(q)),
                        "indexer KL backward");
      return {dq, dk.to(k.scalar_type()), dw, Tensor(), Tensor(), Tensor()};
    }
#endif
    // dq and dw are written once per row (one rounding), so they take the inputs' dtype: no
    // full-length fp32 buffer (16 KB a token of hybrid-3b's indexer queries) and no copy back.
    Tensor dq = torch::empty(q.sizes(), q.options());
    Tensor dw = torch::empty(w.sizes(), w.options());
    Tensor dk = torch::zeros({B * P, DI}, k.options().dtype(ct));
    for (int64_t t0 = 0; t0 < q.size(2); t0 += block) {
      const int64_t n = std::min(block, q.size(2) - t0);
      const KlBlock r = KlRows(q, k, w, pool_idx, target, t0, n, ct);
      Tensor dlog = ((r.logp.exp() * r.target.sum(-1, /*keepdim=*/true) - r.target) * g * inv_sqrt)
                        .masked_fill(r.valid.logical_not(), 0.0);  // (B, n, kp), the 1 / sqrt(DI) folded in
      dw.narrow(1, t0, n).copy_(torch::einsum("bhqp,bqp->bqh", {r.dots.relu(), dlog}));
      Tensor ddots = (r.dots > 0).to(ct) * dlog.unsqueeze(1) * r.wi.permute({0, 2, 1}).unsqueeze(-1);  // (B, HI, n, kp)
      dq.narrow(2, t0, n).copy_(torch::einsum("bhqp,bqpd->bhqd", {ddots, r.ksel}));
      Tensor dksel = torch::einsum("bhqp,bhqd->bqpd", {ddots, r.qi});  // (B, n, kp, DI); 0 at invalid entries
      dk.index_add_(0, r.pic.reshape(-1), dksel.reshape({B * n * kp, DI}));
    }
    return {dq, dk.view({B, P, DI}).to(k.scalar_type()), dw, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

namespace {

// The main attention's keys as the warm-up target's scores read them: k as (B * Hkv, S, D), each
// KV head's keys multiplied with its G query heads' rows at once (no copy of k per query head).
// On CUDA with 16-bit q and k the products run on the tensor cores with fp32 outputs (at::bmm's
// out_dtype form): the 16-bit operands and fp32 accumulation of the main attention's own scores,
// ~10x the rate of fp32 FFMA products. Otherwise q and k in the compute dtype (fp32 or fp64).
// With the CUDA kernels (kernels/cuda/warmup_target.h: bf16 q and k of head dim 128 on a GPU,
// while FusedKernelsEnabled()), the target never forms the scores: `kernel` is set and q, k are
// kept as the kernels read them instead.
struct WarmupKeys {
  Tensor grouped;  // (B * Hkv, S, D)
  bool tensor_cores = false;
  bool kernel = false;
  Tensor q_rows, k_rows;  // the kernels' q and k
};

// Whether the target of q (B, H, S, D) and k (B, Hkv, S, D) goes through the CUDA kernels.
bool WarmupTargetByKernels(const Tensor& q, const Tensor& k) {
#ifdef ODYSSEY_KERNELS_CUDA
  return q.is_cuda() && q.scalar_type() == torch::kBFloat16 && k.scalar_type() == torch::kBFloat16 &&
         FusedKernelsEnabled() && cuda::WarmupTargetSupported(q.size(0), q.size(1), k.size(1), q.size(3));
#else
  (void)q, (void)k;
  return false;
#endif
}

// Whether a x b's matmuls take their 16-bit operands as they are, on the tensor cores with fp32
// outputs (at::bmm's out_dtype form): both of one 16-bit dtype, on a GPU.
bool TensorCoreOperands(const Tensor& a, const Tensor& b) {
  return a.is_cuda() && a.scalar_type() == b.scalar_type() &&
         (a.scalar_type() == torch::kBFloat16 || a.scalar_type() == torch::kHalf);
}

WarmupKeys MakeWarmupKeys(const Tensor& q, const Tensor& k, torch::ScalarType ct) {
  const bool tc = TensorCoreOperands(q, k);
#ifdef ODYSSEY_KERNELS_CUDA
  if (WarmupTargetByKernels(q, k)) {
    WarmupKeys keys;
    keys.kernel = true;
    keys.q_rows = Rows(q);
    keys.k_rows = Rows(k);
    return keys;
  }
#endif
  WarmupKeys keys;
  keys.grouped = (tc ? k : k.to(ct)).reshape({k.size(0) * k.size(1), k.size(2), k.size(3)}).contiguous();
  keys.tensor_cores = tc;
  return keys;
}

#ifdef ODYSSEY_KERNELS_CUDA
// The target's pooled sums over heads of rows [t0, t0 + n) by the CUDA kernels: (B, n, pv) fp32,
// pv = (t0 + n) / 4; 0 on the pools a row cannot see.
Tensor WarmupPooledByKernels(const WarmupKeys& keys, int64_t t0, int64_t n) {
  const Tensor &q = keys.q_rows, &k = keys.k_rows;
  c10::cuda::CUDAGuard guard(q.device());
  const int64_t B = q.size(0), H = q.size(1), pv = (t0 + n) / 4;
  const cuda::WarmupTargetArgs a{q.data_ptr(), q.stride(0), q.stride(1), q.stride(2), k.data_ptr(),
                                 k.stride(0), k.stride(1), k.stride(2), B, H, k.size(1), q.size(2), q.size(3), t0, n,
                                 static_cast<float>(1.0 / std::sqrt(static_cast<double>(q.size(3))))};
  const auto f32 = q.options().dtype(torch::kFloat32);
  Tensor part = torch::empty({B, H, n, cuda::WarmupTargetKeyTiles(a)}, f32);
  CheckKernelLaunch(cuda::WarmupTargetLse(a, part.data_ptr<float>(), Stream(q)), "dense warm-up target log-sum-exp");
  const Tensor lse = part.logsumexp(-1).contiguous();  // (B, H, n): every row sees key 0
  Tensor pooled = torch::empty({B, n, pv}, f32);
  CheckKernelLaunch(cuda::WarmupTargetPools(a, lse.data_ptr<float>(), pooled.data_ptr<float>(), pv, Stream(q)),
                    "dense warm-up target pools");
  return pooled;
}
#endif

// The (B, H, n, kv) scores q k^T / sqrt(D) of query rows [t0, t0 + n) against keys [0, kv), in
// ct.
Tensor WarmupTargetScores(const Tensor& q, const WarmupKeys& keys, int64_t t0, int64_t n, int64_t kv,
                          torch::ScalarType ct) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(3), BH = keys.grouped.size(0), G = B * H / BH;
  const Tensor kt = keys.grouped.narrow(1, 0, kv).transpose(1, 2);
  const Tensor qb = q.narrow(2, t0, n);
  const Tensor s = keys.tensor_cores ? at::bmm(qb.reshape({BH, G * n, D}), kt, ct)
                                     : at::bmm(qb.to(ct).reshape({BH, G * n, D}), kt);
  return s.mul_(1.0 / std::sqrt(static_cast<double>(D))).view({B, H, n, kv});
}

// The dense warm-up's target for query rows [t0, t0 + n): the main attention's probabilities
// (no gradient), head-averaged, summed within each pool of 4 keys and L1-normalised over the
// pools visible from each row: (B, n, P), 0 on the pools a row cannot see. keys: the main
// attention's k (MakeWarmupKeys).
Tensor WarmupTarget(const Tensor& q, const WarmupKeys& keys, int64_t t0, int64_t n, int64_t P, const Tensor& valid,
                    torch::ScalarType ct) {
  torch::NoGradGuard no_grad;
  const int64_t B = q.size(0), H = q.size(1);
  auto lo = torch::TensorOptions().dtype(torch::kLong).device(q.device());
  // Only keys [0, t0 + n) are visible from the block: the later ones are neither scored nor
  // pooled (the pools past the visible ones are 0 in the target).
  const int64_t kv = t0 + n, pv = kv / 4;
#ifdef ODYSSEY_KERNELS_CUDA
  if (keys.kernel) {
    // The sum over heads rather than their mean: the same target once each row is normalised.
    Tensor target = torch::constant_pad_nd(WarmupPooledByKernels(keys, t0, n), {0, P - pv});
    return target.div_(target.sum(-1, /*keepdim=*/true).clamp_min(1e-30)).to(ct);
  }
#endif
  Tensor s = WarmupTargetScores(q, keys, t0, n, kv, ct);  // (B, H, n, kv)
  // Only the last n keys can lie past a row of the block (key t0 + i is past row t0 + j when
  // i > j): the causal mask touches that (n, n) corner alone.
  s.narrow(3, t0, n).masked_fill_(torch::ones({n, n}, lo.dtype(torch::kBool)).triu(1), -kInf);
  const Tensor p = torch::softmax(s, -1).sum(1).div_(static_cast<double>(H));  // (B, n, kv)
  s = Tensor();
  Tensor target = torch::constant_pad_nd(p.narrow(2, 0, 4 * pv).view({B, n, pv, 4}).sum(-1), {0, P - pv})
                      .masked_fill_(valid.logical_not(), 0.0);
  return target.div_(target.sum(-1, /*keepdim=*/true).clamp_min(1e-30));
}

// Pool p is visible from position t when its last key, 4p + 3, is: (1, n, P) for rows [t0, t0 + n).
Tensor WarmupVisible(int64_t t0, int64_t n, int64_t P, const torch::Device& device) {
  auto lo = torch::TensorOptions().dtype(torch::kLong).device(device);
  return torch::arange(P, lo).view({1, 1, P}) * 4 + 3 <= torch::arange(t0, t0 + n, lo).view({1, n, 1});
}

// One block of query rows [t0, t0 + n) of the dense warm-up's KL by autograd through the
// indexer's log-softmax over the visible pools (differentiable in qi (B, HI, n, DI), k_idx and
// wi (B, n, HI) when grad mode is on): DenseWarmupKlReference's form, and the formula the
// Function's gradients by hand (WarmupBlockByHand) are checked against.
Tensor WarmupBlockKl(const Tensor& qi, const Tensor& k_idx, const Tensor& wi, const Tensor& q, const WarmupKeys& keys,
                     int64_t t0, torch::ScalarType ct) {
  const int64_t B = q.size(0), n = qi.size(2), P = k_idx.size(1);
  const Tensor valid = WarmupVisible(t0, n, P, q.device()).expand({B, n, P});
  const Tensor target = WarmupTarget(q, keys, t0, n, P, valid, ct);
  return KlSum(target, MaskedLogSoftmax(IndexerScores(qi.to(ct), k_idx.to(ct), wi.to(ct)), valid));
}

// One block of the KL with its gradients written out, no autograd: the block's launches are a
// third of the graph form's and nothing is recorded, which matters because a long sequence has
// tens of thousands of blocks a layer. Only the pools visible from the block, [0, (t0 + n) / 4),
// are scored. With s = sum_h w_h relu(q_h . k_p) / sqrt(DI) and the log-softmax over the visible
// pools, dKL/ds = softmax(s) * sum(target) - target per row; then
// dw_h = sum_p ds_p relu(q_h . k_p), and through the relu's active dot products dq_h and dk_p.
// The value is returned; with `grads`, the block's rows of dq (B, HI, S, DI) and dw (B, S, HI)
// are written and dk (B, P, DI) is added to, for a unit upstream gradient.
// With 16-bit q_idx and k_idx on a GPU the three matmuls run on the tensor cores with fp32
// outputs (at::bmm's out_dtype form): the dot products' operands are the 16-bit values either
// way, so a's products are exact and only the summation order changes; dq and dk take the
// gradient dd rounded to q_idx's dtype (one rounding, 2^-9 relative, where dq is rounded to it
// anyway and dk sums fp32 products). fp32 FFMA matmuls were a third of the KL's time (2026-12-05,
// one H200: 1.44 of 4.62 s a layer at 128K tokens).
struct WarmupGrads {
  Tensor dq, dk, dw;
};
Tensor WarmupBlockByHand(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w, const Tensor& q,
                         const WarmupKeys& keys, int64_t t0, int64_t n, torch::ScalarType ct, WarmupGrads* grads) {
  const int64_t B = q.size(0), HI = q_idx.size(1), DI = q_idx.size(3), P = k_idx.size(1);
  const int64_t pv = std::min(P, (t0 + n) / 4);  // the pools any row of the block sees
  if (pv == 0) return torch::zeros({}, q_idx.options().dtype(ct));
  const Tensor valid = WarmupVisible(t0, n, pv, q.device()).expand({B, n, pv});
  const Tensor target = WarmupTarget(q, keys, t0, n, pv, valid, ct);  // (B, n, pv)
  const double scale = 1.0 / std::sqrt(static_cast<double>(DI));
  const bool tc = TensorCoreOperands(q_idx, k_idx);
  const auto mt = tc ? q_idx.scalar_type() : ct;  // the matmuls' operand dtype
  const Tensor qb = q_idx.narrow(2, t0, n).to(mt).contiguous();   // (B, HI, n, DI)
  const Tensor kb = k_idx.narrow(1, 0, pv).to(mt).contiguous();   // (B, pv, DI)
  const Tensor wb = w.narrow(1, t0, n).to(ct).permute({0, 2, 1});  // (B, HI, n)
  // x (B, r, c) times y (B, c, m) with ct outputs.
  auto mm = [&](const Tensor& x, const Tensor& y) { return tc ? at::bmm(x, y, ct) : at::bmm(x, y); };
  Tensor a = mm(qb.view({B, HI * n, DI}), kb.transpose(1, 2)).view({B, HI, n, pv}).relu_();  // (B, HI, n, pv)
  const Tensor s = (a * wb.unsqueeze(-1)).sum(1).mul_(scale);         // (B, n, pv)
  const Tensor sm = s.masked_fill(valid.logical_not(), -kInf);
  const Tensor lse = sm.logsumexp(-1, /*keepdim=*/true);  // -inf on a row without a visible pool
  const Tensor has = target.sum(-1, /*keepdim=*/true);    // 1, or 0 on such a row
  const Tensor logp = sm - lse;
  const Tensor value = torch::where(target > 0, target * (target.clamp_min(1e-30).log() - logp),
                                    torch::zeros({}, logp.options()))
                           .sum();
  if (grads == nullptr) return value;
  const Tensor ds = torch::where(has > 0, logp.exp(), torch::zeros({}, logp.options())).mul_(has).sub_(target).mul_(scale);
  grads->dw.narrow(1, t0, n).copy_((a * ds.unsqueeze(1)).sum(-1).permute({0, 2, 1}));  // (B, n, HI)
  // dL/d(q . k) = ds * w_h where the relu passed the dot product, 0 elsewhere.
  Tensor dd = (ds.unsqueeze(1) * wb.unsqueeze(-1)).masked_fill_(a <= 0, 0.0).to(mt).contiguous();  // (B, HI, n, pv)
  a = Tensor();
  const Tensor ddr = dd.view({B, HI * n, pv});
  grads->dq.narrow(2, t0, n).copy_(mm(ddr, kb).view({B, HI, n, DI}));
  grads->dk.narrow(1, 0, pv).add_(mm(ddr.transpose(1, 2), qb.view({B, HI * n, DI})));
  return value;
}

// The KL summed over query blocks of query_block rows by autograd (DenseWarmupKlReference):
// differentiable in q_idx, k_idx and w when grad mode is on, keeping every block's graph.
Tensor WarmupKlValue(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w, const Tensor& q, const Tensor& k,
                     int64_t query_block) {
  const auto ct = ComputeType({&q_idx, &k_idx, &w, &q, &k});
  const WarmupKeys kq = MakeWarmupKeys(q, k, ct);
  Tensor total = torch::zeros({}, q_idx.options().dtype(ct));
  for (int64_t t0 = 0; t0 < q.size(2); t0 += query_block) {
    const int64_t n = std::min(query_block, q.size(2) - t0);
    total = total + WarmupBlockKl(q_idx.narrow(2, t0, n), k_idx, w.narrow(1, t0, n), q, kq, t0, ct);
  }
  return total;
}

// One pass over the query blocks. With `with_grad` (grad mode on and an input requiring a gradient:
// the plain forward, or a checkpoint's recompute right before its backward), each block's
// gradients are formed by hand for a unit upstream gradient in the forward itself
// (WarmupBlockByHand), and the backward only scales the three gradients: the main attention's
// target, the block's costliest part (H (n, S) score rows), is formed once per step instead of
// once in the forward and again in the backward. Without it (a checkpoint's first, no-grad
// forward) only the value is formed and nothing is kept.
struct DenseWarmupKlFunction : public torch::autograd::Function<DenseWarmupKlFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q_idx, const Tensor& k_idx, const Tensor& w,
                               const Tensor& q, const Tensor& k, int64_t query_block, bool with_grad) {
    RECORD_USER_SCOPE("dsa warm-up KL");
    const auto ct = ComputeType({&q_idx, &k_idx, &w, &q, &k});
    const WarmupKeys kq = MakeWarmupKeys(q, k, ct);
    Tensor total = torch::zeros({}, q_idx.options().dtype(ct));
    Tensor dq, dk, dw;
    WarmupGrads d;
    if (with_grad) {
      dq = torch::zeros_like(q_idx), dw = torch::zeros_like(w);
      dk = torch::zeros(k_idx.sizes(), k_idx.options().dtype(ct));  // summed over every block: in ct
      d = {dq, dk, dw};
    }
    for (int64_t t0 = 0; t0 < q.size(2); t0 += query_block) {
      const int64_t n = std::min(query_block, q.size(2) - t0);
      total += WarmupBlockByHand(q_idx, k_idx, w, q, kq, t0, n, ct, with_grad ? &d : nullptr);
    }
    if (!with_grad) return {total};
    ctx->save_for_backward({dq, dk, dw});
    ctx->saved_data["k_dtype"] = k_idx.scalar_type();
    return {total};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    TORCH_CHECK(!s.empty(), "DenseWarmupKl: backward through a forward that ran without gradients");
    const Tensor &dq = s[0], &dk = s[1], &dw = s[2];
    const auto k_dtype = ctx->saved_data["k_dtype"].toScalarType();
    const Tensor g = grads[0].to(dk.scalar_type());
    // dk is summed over blocks in the compute type: scaled there, rounded once.
    return {dq * g.to(dq.scalar_type()), (dk * g).to(k_dtype), dw * g.to(dw.scalar_type()), Tensor(), Tensor(),
            Tensor(), Tensor()};
  }
};

void CheckDenseWarmupKl(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w, const Tensor& q, const Tensor& k,
                        int64_t query_block) {
  TORCH_CHECK(q_idx.dim() == 4 && k_idx.dim() == 3 && w.dim() == 3 && k_idx.size(0) == q_idx.size(0) &&
                  k_idx.size(2) == q_idx.size(3) &&
                  w.sizes() == torch::IntArrayRef({q_idx.size(0), q_idx.size(2), q_idx.size(1)}),
              "DenseWarmupKl: q_idx (B, HI, S, DI), k_idx (B, P, DI), w (B, S, HI)");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && q.size(0) == q_idx.size(0) && q.size(2) == q_idx.size(2) &&
                  k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.size(3) == q.size(3) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "DenseWarmupKl: q (B, H, S, D) and k (B, Hkv, S, D) with Hkv dividing H, over q_idx's S positions");
  TORCH_CHECK(k_idx.size(1) == q.size(2) / 4, "DenseWarmupKl: k_idx must hold the S / 4 pools of 4 tokens (",
              q.size(2) / 4, "), got ", k_idx.size(1));
  TORCH_CHECK(query_block >= 1, "DenseWarmupKl: query_block must be >= 1");
}

}  // namespace

Tensor DenseWarmupKl(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w, const Tensor& q, const Tensor& k,
                     int64_t query_block) {
  CheckDenseWarmupKl(q_idx, k_idx, w, q, k, query_block);
  const bool with_grad =
      torch::GradMode::is_enabled() && (q_idx.requires_grad() || k_idx.requires_grad() || w.requires_grad());
  return DenseWarmupKlFunction::apply(q_idx, k_idx, w, q.detach(), k.detach(), query_block, with_grad)[0];
}

Tensor DenseWarmupKlReference(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w, const Tensor& q,
                              const Tensor& k, int64_t query_block) {
  CheckDenseWarmupKl(q_idx, k_idx, w, q, k, query_block);
  return WarmupKlValue(q_idx, k_idx, w, q.detach(), k.detach(), query_block);
}

int64_t DenseWarmupKlBlock(int64_t S, int64_t heads, int64_t index_heads, bool target_by_kernels) {
  // The block's largest transients: the (H, n, S) scores and their softmax (the libtorch target
  // only: the kernels never form them), the (HI, n, S / 4) relu'd dot products, their products
  // with w and ds and their gradient, fp32: ~512 MiB of each kind (~2.5 x 512 MiB in all for
  // hybrid-3b's 24 heads and 32 indexer heads). Blocks are large because each costs a fixed
  // ~30-50 launches: at 128K tokens, 128 MiB blocks (8 rows) made the KL ~34 s a layer on an
  // H100, almost all of it launch overhead. With the target by the kernels the block's
  // transients are the indexer's (HI, n, S / 4) fp32 tensors alone, 2 GiB of each kind: at 128K
  // tokens 512-row blocks took the KL 14% below 128-row ones (2026-12-05, one H200: 3.90 against
  // 4.54 s a layer). planner/planner.cc counts the same budgets.
  if (target_by_kernels) return std::clamp<int64_t>((int64_t{2} << 30) / std::max<int64_t>(1, S * index_heads), 1, 1024);
  const int64_t per_row = std::max<int64_t>(1, S * 4 * std::max(heads, index_heads));
  return std::clamp<int64_t>((int64_t{512} << 20) / per_row, 1, 1024);
}

int64_t DenseWarmupKlBlockFor(const Tensor& q_idx, const Tensor& q, const Tensor& k) {
  return DenseWarmupKlBlock(q.size(2), q.size(1), q_idx.size(1), WarmupTargetByKernels(q, k));
}

Tensor IndexerKlLoss(const Tensor& q_idx, const Tensor& k_idx, const Tensor& w, const Tensor& pool_idx,
                     const Tensor& target, int64_t query_block) {
  TORCH_CHECK(q_idx.dim() == 4 && k_idx.dim() == 3 && w.dim() == 3 && k_idx.size(0) == q_idx.size(0) &&
                  k_idx.size(2) == q_idx.size(3) && w.sizes() == torch::IntArrayRef({q_idx.size(0), q_idx.size(2),
                                                                                     q_idx.size(1)}),
              "IndexerKlLoss: q_idx (B, HI, S, D), k_idx (B, P, D), w (B, S, HI)");
  TORCH_CHECK(pool_idx.dim() == 3 && pool_idx.scalar_type() == torch::kInt32 && pool_idx.size(0) == q_idx.size(0) &&
                  pool_idx.size(1) == q_idx.size(2) && target.sizes() == pool_idx.sizes(),
              "IndexerKlLoss: pool_idx (B, S, kp) int32 and target of its shape");
  TORCH_CHECK(query_block >= 1, "IndexerKlLoss: query_block must be >= 1");
  // (The kernels would read outside k_idx; libtorch's gather would fail without naming the rule.)
  CheckIndexRange("IndexerKlLoss", pool_idx, k_idx.size(1), "pool_idx must lie in [-1, P) (P = ", ", k_idx's pools)");
  return IndexerKlFunction::apply(q_idx, k_idx, w, pool_idx, target.detach(), query_block)[0];
}

Tensor SparseAttention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices, double scale,
                       int64_t query_block, int64_t backward_pairs) {
  CheckSparseAttention("SparseAttention", q, k, v, indices, query_block);
  CheckBackwardPairs("SparseAttention", backward_pairs);
  return SparseAttentionFunction::apply(q, k, v, indices, ResolveScale(scale, q), query_block, backward_pairs)[0];
}

SparseAttentionResult SparseAttentionForward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& indices,
                                             double scale, int64_t query_block) {
  CheckSparseAttention("SparseAttentionForward", q, k, v, indices, query_block);
  return ForwardImpl(q, k, v, indices, ResolveScale(scale, q), query_block);
}

Tensor SparseAttentionBackward(const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& indices, const Tensor& lse, double scale, Tensor& dk_acc, Tensor& dv_acc,
                               int64_t query_block, int64_t backward_pairs) {
  constexpr const char* kFn = "SparseAttentionBackward";
  CheckSparseAttention(kFn, q, k, v, indices, query_block);
  CheckBackwardPairs(kFn, backward_pairs);
  const int64_t B = q.size(0), H = q.size(1), Hkv = k.size(1), Sq = q.size(2), Sk = k.size(2), D = q.size(3),
                Dv = v.size(3);
  const auto ct = ComputeType({&q, &k, &v});
  TORCH_CHECK(grad_out.sizes() == torch::IntArrayRef({B, H, Sq, Dv}), kFn, ": grad_out must be (B, H, Sq, Dv) = (",
              B, ", ", H, ", ", Sq, ", ", Dv, "), got ", grad_out.sizes());
  TORCH_CHECK(lse.sizes() == torch::IntArrayRef({B, H, Sq}) && lse.scalar_type() == ct, kFn,
              ": lse must be (B, H, Sq) = (", B, ", ", H, ", ", Sq, ") in ", ct, " (the forward's), got ", lse.sizes(),
              " ", lse.scalar_type());
  auto check_acc = [&](const Tensor& acc, const char* name, const char* dim, int64_t cols) {
    TORCH_CHECK(acc.sizes() == torch::IntArrayRef({B, Hkv, Sk, cols}) && acc.scalar_type() == ct &&
                    acc.is_contiguous() && acc.device() == q.device(),
                kFn, ": ", name, " must be a contiguous (B, Hkv, Sk, ", dim, ") = (", B, ", ", Hkv, ", ", Sk, ", ", cols,
                ") ", ct, " tensor on q's device, got ", acc.sizes(), " ", acc.scalar_type(),
                acc.is_contiguous() ? "" : " non-contiguous", " on ", acc.device());
  };
  check_acc(dk_acc, "dk_acc", "D", D);
  check_acc(dv_acc, "dv_acc", "Dv", Dv);
  return BackwardImpl(grad_out, q, k, v, indices, lse, ResolveScale(scale, q), query_block, backward_pairs, dk_acc,
                      dv_acc);
}

void SetSparseTensorCores(bool enabled) {
#ifdef ODYSSEY_KERNELS_CUDA
  cuda::SetSparseAttentionTensorCores(enabled);
#else
  (void)enabled;  // no kernels built: nothing runs on the tensor cores
#endif
}

bool SparseTensorCores() {
#ifdef ODYSSEY_KERNELS_CUDA
  return cuda::SparseAttentionTensorCores();
#else
  return false;
#endif
}

int64_t SparseTensorCoreLaunches() {
#ifdef ODYSSEY_KERNELS_CUDA
  return cuda::SparseAttentionTensorCoreLaunches();
#else
  return 0;
#endif
}

}  // namespace odyssey::kernels
