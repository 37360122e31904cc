#include "kernels/kda.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <ATen/record_function.h>
#include <torch/torch.h>

#ifdef ODYSSEY_KERNELS_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "kernels/cuda/kda_intra.h"
#include "kernels/cuda/kda_scan.h"
#endif
#include "kernels/cuda/kda_intra_backward.h"
#include "kernels/fused_ops.h"
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
  // qg, kg and W are bf16 where the kernels keep them so (SetKdaScanBf16Operands): only the
  // state scans read them then.
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

Tensor DecayedGram(const Tensor& x, const Tensor& y, const Tensor& G, bool strict, KdaGramForm form);

// (n, n) bool, [i, j] kept where j < i (strict) or j <= i.
Tensor LowerMask(int64_t n, bool strict, const torch::Device& device) {
  return torch::ones({n, n}, torch::TensorOptions().dtype(torch::kBool).device(device)).tril(strict ? -1 : 0);
}
// a b^T with the entries above the diagonal (on it too when strict) set to zero.
Tensor LowerProduct(const Tensor& a, const Tensor& b, bool strict) {
  Tensor m = a.matmul(b.transpose(-1, -2));
  return torch::where(LowerMask(m.size(-1), strict, m.device()), m, torch::zeros({}, m.options()));
}

// G = the chunk-local cumulative sum of g (B, HV, T, K) -> (B, HV, N, C, K) in `ct` (fp32/fp64),
// g read in its own dtype: one pass.
Tensor ChunkCumsum(const Tensor& g, int64_t C, torch::ScalarType ct) { return Chunk(g, C).cumsum(-2, ct); }

// What the hand-written backward of the whole-chunk form (IntraBackward) reads, kept by
// ComputeIntra when asked: every tensor (B, HV, N, C, .) of the segment's chunks.
struct IntraCache {
  Tensor kc, vc, bc;  // the chunked inputs (bc: beta (.., C, 1))
  Tensor eG;          // exp(G)
  Tensor Ep, Em;      // exp(G - G_0), exp(G_0 - G) against the chunk's first row
  Tensor qp, kp, km;  // q * Ep, k * Ep, k * Em
  Tensor Lkk;         // strict-lower (k Ep)(k Em)^T: A_kk before beta's row scaling
  Tensor X, Y;        // beta k exp(G), beta v: W = T X, U = T Y
  Tensor EC;          // exp(G_C - G): kg = k * EC
};

// The process-wide switches and counters of kernels/kda.h.
std::atomic<KdaIntraBackwardPath> intra_backward_path{KdaIntraBackwardPath::kAuto};
std::atomic<bool> scan_tensor_cores{true};
std::atomic<int64_t> scan_tensor_core_launches{0};
std::atomic<int64_t> intra_backward_kernel_runs{0};
std::atomic<int64_t> sub_forward_kernel_runs{0};
std::atomic<int64_t> direct_input_runs{0};
std::atomic<int64_t> direct_grad_runs{0};
std::atomic<bool> direct_inputs{true};
std::atomic<bool> scan_bf16_operands{true};
std::atomic<int> scan_value_block{32};
std::atomic<int64_t> bf16_operand_scans{0};
std::atomic<bool> intra_backward_reads_inverse{true};
std::atomic<int64_t> inverse_reads{0};
std::atomic<int64_t> intra_element_loads{0};

// The kernels' bits (kernels/cuda/kda_intra.h kKdaBf16*) of the inputs that are bf16.
uint8_t Bf16Bits(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta) {
  auto bit = [](const Tensor& t, uint8_t b) { return t.scalar_type() == torch::kBFloat16 ? b : uint8_t{0}; };
  return bit(q, cuda::kKdaBf16Q) | bit(k, cuda::kKdaBf16K) | bit(v, cuda::kKdaBf16V) | bit(beta, cuda::kKdaBf16Beta);
}
// Whether the chunk kernels read t as it is: fp32 or bf16.
bool KernelDtype(const Tensor& t) {
  return t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16;
}
// And q, k, v together: one dtype the kernels read (they are built for all fp32 or all bf16).
bool KernelDtypes(const Tensor& q, const Tensor& k, const Tensor& v) {
  return KernelDtype(q) && k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type();
}
// The one rule for inputs the chunk kernels read as they are: q, k, v of one of their dtypes, beta
// of either, q's, k's and v's rows contiguous (any batch, head and token strides).
bool KernelReadable(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta) {
  return KernelDtypes(q, k, v) && KernelDtype(beta) && q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1;
}

// The chunk quantities' outputs allocated in `in` (fp32, G's device; qg, kg and W bf16 with
// `wqk_bf16`) and the arguments of the kernels that write them (kernels/cuda/kda_intra.h),
// without a cache; q is scaled by q_scale as the kernels read it.
cuda::KdaIntraArgs IntraArgsOf(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, const Tensor& Gd,
                               int64_t C, Intra* in, double q_scale, bool wqk_bf16 = false) {
  const int64_t B = q.size(0), HV = q.size(1), L = q.size(2), K = q.size(3), V = v.size(3), N = Gd.size(2);
  auto opts = Gd.options();
  const auto wqk = wqk_bf16 ? opts.dtype(torch::kBFloat16) : opts;
  in->qg = torch::empty({B, HV, N, C, K}, wqk);
  in->kg = torch::empty({B, HV, N, C, K}, wqk);
  in->W = torch::empty({B, HV, N, C, K}, wqk);
  in->U = torch::empty({B, HV, N, C, V}, opts);
  in->Aqk = torch::empty({B, HV, N, C, C}, opts);
  in->eGC = torch::empty({B, HV, N, K}, opts);
  cuda::KdaIntraArgs a{q.data_ptr(), k.data_ptr(), v.data_ptr(), beta.data_ptr(), Gd.data_ptr<float>(),
                       q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0),
                       v.stride(1), v.stride(2), beta.stride(0), beta.stride(1), beta.stride(2), B, HV, N, C, K, V, L,
                       static_cast<float*>(in->qg.data_ptr()), static_cast<float*>(in->kg.data_ptr()),
                       static_cast<float*>(in->W.data_ptr()),
                       in->U.data_ptr<float>(), in->Aqk.data_ptr<float>(), in->eGC.data_ptr<float>(), nullptr};
  a.bf16 = Bf16Bits(q, k, v, beta);
  a.q_scale = static_cast<float>(q_scale);
  a.wqk_bf16 = wqk_bf16;
  return a;
}

#ifdef ODYSSEY_KERNELS_CUDA
// Contiguous, starting on a 16-byte boundary (the kernels' float4 accesses).
Tensor Dense(const Tensor& t) {
  Tensor c = t.contiguous();
  return reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 == 0 ? c : c.clone();
}
void* Stream(const Tensor& t) { return c10::cuda::getCurrentCUDAStream(t.device().index()).stream(); }

// Whether the state scans take qg, kg and W in bf16 for these sizes: the switch on, the
// tensor-core scans, and sizes the kernels take (KernelScans' rule, the value block's).
bool ScanTakesBf16Operands(int64_t BH, int64_t C, int64_t K, int64_t V) {
  return scan_bf16_operands.load() && scan_tensor_cores.load() && FusedKernelsEnabled() && BH <= 65535 &&
         V % 8 == 0 && cuda::KdaScanBf16OperandsSupported(C, K, V, scan_value_block.load());
}

// The whole-chunk form's quantities by one CUDA kernel (kernels/cuda/kda_intra.h) for CUDA
// tensors of supported sizes while FusedKernelsEnabled(): G fp32, q, k, v, beta fp32 or bf16 (all
// fp32 with a cache, whose chunked inputs libtorch reads), q scaled by q_scale as read; false: the
// caller builds them with libtorch ops. `for_scans`: qg, kg and W feed only the state scans (the
// forward's; the backward's recompute and reverse scan where the intra backward is the kernel's),
// which take them in bf16 where ScanTakesBf16Operands. `keep_T` (no cache): T = (I + A_kk)^-1 kept
// in in->T (fp32) for the intra backward kernel of the same segment (KdaIntraBackwardArgs::T).
bool IntraByKernel(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& G, const Tensor& beta, int64_t C,
                   Intra* in, IntraCache* cache, double q_scale, bool for_scans = false, bool keep_T = false) {
  const int64_t B = q.size(0), HV = q.size(1), K = q.size(3), V = v.size(3), N = G.size(2);
  const bool fp32 = q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                    v.scalar_type() == torch::kFloat32 && beta.scalar_type() == torch::kFloat32;
  if (!FusedKernelsEnabled() || !q.is_cuda() || !KernelReadable(q, k, v, beta) ||
      (cache != nullptr && (!fp32 || q_scale != 1.0)) || G.scalar_type() != torch::kFloat32 ||
      !cuda::KdaIntraSupported(C, K, V) || B * HV > 65535) {
    return false;
  }
  c10::cuda::CUDAGuard guard(q.device());
  const Tensor Gd = Dense(G);
  auto opts = Gd.options();
  const bool wqk_bf16 = for_scans && cache == nullptr && ScanTakesBf16Operands(B * HV, C, K, V);
  cuda::KdaIntraArgs a = IntraArgsOf(q, k, v, beta, Gd, C, in, q_scale, wqk_bf16);
  cuda::KdaIntraCache kc{};
  if (cache != nullptr) {
    in->T = torch::empty({B, HV, N, C, C}, opts);
    cache->Lkk = torch::empty({B, HV, N, C, C}, opts);
    for (Tensor* t : {&cache->Ep, &cache->Em, &cache->qp, &cache->kp, &cache->km, &cache->X, &cache->EC, &cache->eG}) {
      *t = torch::empty({B, HV, N, C, K}, opts);
    }
    cache->Y = torch::empty({B, HV, N, C, V}, opts);
    cache->kc = Chunk(k, C), cache->vc = Chunk(v, C), cache->bc = Chunk(beta, C).unsqueeze(-1);
    auto f = [](Tensor& t) { return t.data_ptr<float>(); };
    kc = {f(in->T), f(cache->Lkk), f(cache->Ep), f(cache->Em), f(cache->qp), f(cache->kp),
          f(cache->km), f(cache->X), f(cache->Y), f(cache->EC), f(cache->eG)};
  }
  if (cache != nullptr) a.cache = &kc;
  if (keep_T && cache == nullptr) {
    in->T = torch::empty({B, HV, N, C, C}, opts);
    a.T_out = in->T.data_ptr<float>();
  }
  a.tf32 = scan_tensor_cores.load();  // the Grams and W, U on the tensor cores with the scans
  if (!cuda::KdaIntraVectorLoads(a)) intra_element_loads.fetch_add(1);
  CheckKernelLaunch(cuda::KdaIntraForward(a, Stream(q)), "kda intra-chunk forward");
  return true;
}
#endif


// Whether the block code of kernels/cuda/kda_intra_backward.h (the intra-chunk backward, the
// sub-block form's forward) may run for tensors on `t`'s device computed in `ct`: the path, the
// device (CUDA under kAuto with the fused kernels on, CPU under the emulation paths), fp32.
// Checked before a segment's inputs are prepared for it.
bool BlockCodeMayRun(const Tensor& t, torch::ScalarType ct) {
  const KdaIntraBackwardPath path = intra_backward_path.load();
  if (path == KdaIntraBackwardPath::kLibtorch) return false;
  if (t.is_cuda()) {
#ifdef ODYSSEY_KERNELS_CUDA
    if (!FusedKernelsEnabled()) return false;
#else
    return false;
#endif
  } else if (path == KdaIntraBackwardPath::kAuto) {
    return false;
  }
  return ct == torch::kFloat32;
}

// Whether the block code takes this segment's inputs (prepared, or the caller's as they are):
// BlockCodeMayRun, fp32 or bf16 inputs of its sizes with contiguous rows.
bool BlockCodeTakes(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& beta, int64_t C) {
  if (!BlockCodeMayRun(q, torch::kFloat32)) return false;
  return KernelReadable(q, k, v, beta) && cuda::KdaIntraBackwardSupported(C, q.size(3), v.size(3)) &&
         q.size(0) * q.size(1) <= 65535;
}

// The sub-block form's chunk quantities by the kernel's block code (no cache: only the kernel's
// backward follows, and it recomputes what it needs).
Intra SubBlockIntraByKernel(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& G, const Tensor& beta,
                            int64_t C, double q_scale) {
  const Tensor Gd = G.contiguous();
  Intra in;
  const cuda::KdaIntraArgs a = IntraArgsOf(q, k, v, beta, Gd, C, &in, q_scale);
  if (q.is_cuda()) {
#ifdef ODYSSEY_KERNELS_CUDA
    c10::cuda::CUDAGuard guard(q.device());
    CheckKernelLaunch(cuda::KdaIntraSubBlockForward(a, Stream(q)), "kda sub-block intra-chunk forward");
#endif
  } else {
    cuda::KdaIntraSubBlockForwardOnHost(a, intra_backward_path.load() == KdaIntraBackwardPath::kKernelCodeOnHostReversed);
  }
  sub_forward_kernel_runs.fetch_add(1);
  return in;
}

// q already scaled and expanded to HV heads, G = ChunkCumsum(g, C, ct), `form` =
// KdaDecayedGramForm(G); all in the compute dtype (ComputeIntraFor below also lets the kernels
// read the caller's tensors). The whole-chunk form shares its factors
// between A_kk and A_qk. With `cache` (whole-chunk form only: the backward's recompute, without
// autograd) keeps what IntraBackward reads. `for_scans` and `keep_T` as IntraByKernel's (the
// libtorch form returns T either way).
Intra ComputeIntra(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& G, const Tensor& beta,
                   int64_t C, KdaGramForm form, IntraCache* cache = nullptr, bool for_scans = false,
                   bool keep_T = false) {
  TORCH_CHECK(cache == nullptr || form == KdaGramForm::kWholeChunk,
              "KDA: the hand backward's cache is for the whole-chunk Gram form only");
#ifdef ODYSSEY_KERNELS_CUDA
  // Not under autograd: the kernel's outputs have no graph (the sub-block forms, which the
  // backward differentiates by autograd, never come here).
  if (form == KdaGramForm::kWholeChunk && !(torch::GradMode::is_enabled() && (q.requires_grad() || k.requires_grad() ||
                                                                              v.requires_grad() || G.requires_grad() ||
                                                                              beta.requires_grad()))) {
    Intra in;
    if (IntraByKernel(q, k, v, G, beta, C, &in, cache, 1.0, for_scans, keep_T)) return in;
  }
#endif
  const bool recorded = torch::GradMode::is_enabled() &&
                        (q.requires_grad() || k.requires_grad() || v.requires_grad() || G.requires_grad() ||
                         beta.requires_grad());
  if (form == KdaGramForm::kSubBlocks && cache == nullptr && !recorded && BlockCodeTakes(q, k, v, beta, C))
    return SubBlockIntraByKernel(q, k, v, G, beta, C, 1.0);
  Tensor qc = Chunk(q, C), kc = Chunk(k, C), vc = Chunk(v, C);  // (B, HV, N, C, K|V)
  // Padding tokens: g = 0 (no decay), beta = 0 (no write), so the state passes them unchanged.
  Tensor bc = Chunk(beta, C).unsqueeze(-1);  // (B, HV, N, C, 1)
  Tensor eG = G.exp();                       // <= 1
  Intra in;
  Tensor Akk;
  if (form == KdaGramForm::kWholeChunk) {
    // DecayedGram's whole-chunk form, both Grams from the same factors.
    IntraCache local;
    IntraCache& c = cache != nullptr ? *cache : local;
    Tensor G0 = G.narrow(-2, 0, 1);
    c.Ep = (G - G0).exp(), c.Em = (G0 - G).exp();
    c.qp = qc * c.Ep, c.kp = kc * c.Ep, c.km = kc * c.Em;
    c.Lkk = LowerProduct(c.kp, c.km, /*strict=*/true);
    Akk = c.Lkk * bc;
    in.Aqk = LowerProduct(c.qp, c.km, /*strict=*/false);
    c.kc = kc, c.vc = vc, c.bc = bc, c.eG = eG;
  } else {
    Akk = DecayedGram(kc, kc, G, /*strict=*/true, form) * bc;  // (B, HV, N, C, C)
    in.Aqk = DecayedGram(qc, kc, G, /*strict=*/false, form);
  }
  Tensor I = torch::eye(C, Akk.options());
  // (I + A_kk) is unit lower triangular: its inverse by forward substitution (batched trsm in
  // the compute dtype), differentiable (dT = -T dA T) for the backward's graph.
  in.T = torch::linalg_solve_triangular(I + Akk, I.expand_as(Akk), /*upper=*/false, /*left=*/true,
                                        /*unitriangular=*/true);
  Tensor X = bc * kc * eG, Y = bc * vc;
  in.W = in.T.matmul(X);
  in.U = in.T.matmul(Y);
  Tensor GC = G.narrow(-2, C - 1, 1);  // (B, HV, N, 1, K)
  Tensor EC = (GC - G).exp();          // exponent <= 0
  in.kg = kc * EC;
  in.qg = qc * eG;
  in.eGC = GC.squeeze(-2).exp();
  if (cache != nullptr) cache->X = X, cache->Y = Y, cache->EC = EC;
  return in;
}

// The gradients of one segment's chunk-parallel inputs (B, HV, len, .) in the compute dtype (q
// as scaled and expanded, k expanded) from those of the chunk quantities, for the whole-chunk
// Gram form: spec 1.4 steps 4-6 by hand (the UT inverse, the Grams against the first row, the
// gates and beta, the chunk-local cumsum), each a batched product or one element-wise pass.
struct IntraGrads {
  Tensor dq, dk, dv, dg, dbeta;
};
IntraGrads IntraBackward(const Intra& in, const IntraCache& c, const Tensor& dqg, const Tensor& dkg,
                         const Tensor& dW, const Tensor& dU, const Tensor& dAqk, const Tensor& deGC, int64_t len) {
  const int64_t C = in.T.size(-1);
  Tensor TT = in.T.transpose(-1, -2);
  // W = T X, U = T Y; T = M^-1 with M = I + A_kk unit lower: dM = -T^T dT T^T on the strict part.
  Tensor dT = dW.matmul(c.X.transpose(-1, -2)) + dU.matmul(c.Y.transpose(-1, -2));
  Tensor dX = TT.matmul(dW), dY = TT.matmul(dU);
  Tensor zero = torch::zeros({}, dT.options());
  Tensor dAkk = torch::where(LowerMask(C, /*strict=*/true, dT.device()), -TT.matmul(dT).matmul(TT), zero);
  // A_kk = diag(beta) L_kk; L_kk = strict((k Ep)(k Em)^T), A_qk = lower((q Ep)(k Em)^T).
  Tensor dbeta = (dAkk * c.Lkk).sum(-1) + (dX * c.kc * c.eG).sum(-1) + (dY * c.vc).sum(-1);  // (.., C)
  Tensor dL = dAkk * c.bc;
  Tensor dA = torch::where(LowerMask(C, /*strict=*/false, dT.device()), dAqk, zero);
  Tensor dkp = dL.matmul(c.km), dqp = dA.matmul(c.km);
  Tensor dkm = dL.transpose(-1, -2).matmul(c.kp) + dA.transpose(-1, -2).matmul(c.qp);
  Tensor dq = dqp * c.Ep + dqg * c.eG;
  Tensor dk = dkp * c.Ep + dkm * c.Em + dX * c.bc * c.eG + dkg * c.EC;
  Tensor dv = dY * c.bc;
  // dG: every factor's exponent; the last row's G_C gets the sum of the kg terms it enters with
  // the opposite sign. The reference row G_0 needs no such term: a Gram depends on differences
  // G_i - G_j only, so its terms sum to zero over the chunk.
  Tensor dkgkg = dkg * in.kg;
  Tensor dG = dqp * c.qp + dkp * c.kp - dkm * c.km + dX * c.X - dkgkg + dqg * in.qg;
  dG.narrow(-2, C - 1, 1).add_(dkgkg.sum(-2, /*keepdim=*/true) + (deGC * in.eGC).unsqueeze(-2));
  // G = cumsum(g) within the chunk: dg_r = sum_{i >= r} dG_i.
  Tensor dg = dG.flip(-2).cumsum(-2).flip(-2);
  auto unchunk = [len](const Tensor& t) {  // (B, HV, N, C, D) -> (B, HV, len, D)
    return t.flatten(2, 3).narrow(2, 0, len);
  };
  return {unchunk(dq), unchunk(dk), unchunk(dv), unchunk(dg), unchunk(dbeta.unsqueeze(-1)).squeeze(-1)};
}

// IntraBackward by the kernel's block code: the input gradients from the segment's inputs (q
// expanded, k expanded, as ComputeIntra took them: prepared, or the caller's fp32 or bf16 tensors
// with q scaled by q_scale as read), G and the chunk quantities' gradients, for the whole-chunk or
// (sub_blocks) the sub-block Gram form; the block recomputes every factor itself (no IntraCache)
// and writes each gradient once, dq times dq_scale. With `out` (dq, dk, dv, dg, dbeta: (B, HV, len,
// .) slices the block can write, GradsOutTake) it writes them there and returns nothing; else into
// tensors of its own, returned: dq, dk, dv in q's dtype, dg and dbeta fp32.
IntraGrads IntraBackwardByKernel(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& G,
                                 const Tensor& beta, double q_scale, const Tensor& dqg, const Tensor& dkg,
                                 const Tensor& dW, const Tensor& dU, const Tensor& dAqk, const Tensor& deGC,
                                 int64_t len, bool sub_blocks, double dq_scale, const std::vector<Tensor>* out,
                                 const Tensor& T = Tensor()) {
  const int64_t B = q.size(0), HV = q.size(1), K = q.size(3), V = v.size(3), N = G.size(2), C = G.size(3);
  auto dense = [](const Tensor& t) { return t.contiguous(); };
  const Tensor Gd = dense(G), dqgd = dense(dqg), dkgd = dense(dkg), dWd = dense(dW), dUd = dense(dU),
               dAqkd = dense(dAqk), deGCd = dense(deGC);
  IntraGrads own;
  if (out == nullptr) {
    auto qo = q.options(), fo = Gd.options();
    own = {torch::empty({B, HV, len, K}, qo), torch::empty({B, HV, len, K}, qo), torch::empty({B, HV, len, V}, qo),
           torch::empty({B, HV, len, K}, fo), torch::empty({B, HV, len}, fo)};
  }
  const std::vector<Tensor> dst =
      out != nullptr ? *out : std::vector<Tensor>{own.dq, own.dk, own.dv, own.dg, own.dbeta};
  auto grad_out = [](const Tensor& t) {
    cuda::KdaGradOut o;
    o.p = t.data_ptr();
    o.sb = t.stride(0), o.sh = t.stride(1), o.st = t.stride(2);
    o.bf16 = t.scalar_type() == torch::kBFloat16;
    return o;
  };
  cuda::KdaIntraBackwardArgs a{q.data_ptr(),          k.data_ptr(),          v.data_ptr(),
                               beta.data_ptr(),       Gd.data_ptr<float>(), q.stride(0),
                               q.stride(1),          q.stride(2),           k.stride(0),
                               k.stride(1),          k.stride(2),           v.stride(0),
                               v.stride(1),          v.stride(2),           beta.stride(0),
                               beta.stride(1),       beta.stride(2),        B,
                               HV,                   N,                     C,
                               K,                    V,                     len,
                               dqgd.data_ptr<float>(), dkgd.data_ptr<float>(), dWd.data_ptr<float>(),
                               dUd.data_ptr<float>(), dAqkd.data_ptr<float>(), deGCd.data_ptr<float>(),
                               grad_out(dst[0]),      grad_out(dst[1]),     grad_out(dst[2]),
                               grad_out(dst[3]),      grad_out(dst[4]),     sub_blocks};
  // The products on the tensor cores with the scans' (the CPU emulation runs the same block code
  // in fp32).
  a.tf32 = scan_tensor_cores.load();
  a.bf16 = Bf16Bits(q, k, v, beta);
  a.q_scale = static_cast<float>(q_scale);
  a.dq_scale = static_cast<float>(dq_scale);
  // The recompute's inverse (fp32, the whole-chunk form, on 16 bytes: the kernel copies its rows
  // by cp.async), read instead of inverting again.
  Tensor Td;
  if (T.defined() && !sub_blocks && T.scalar_type() == torch::kFloat32 && T.device() == q.device()) {
    TORCH_CHECK(T.sizes() == torch::IntArrayRef({B, HV, N, C, C}), "KDA: the recompute's T has shape ", T.sizes(),
                ", the intra backward wants (", B, ", ", HV, ", ", N, ", ", C, ", ", C, ")");
    Td = T.contiguous();
    if (reinterpret_cast<uintptr_t>(Td.data_ptr()) % 16 != 0) Td = Td.clone();
    a.T = Td.data_ptr<float>();
    inverse_reads.fetch_add(1);
  }
  if (q.is_cuda()) {
#ifdef ODYSSEY_KERNELS_CUDA
    c10::cuda::CUDAGuard guard(q.device());
    CheckKernelLaunch(cuda::KdaIntraBackward(a, Stream(q)), "kda intra-chunk backward");
#endif
  } else {
    cuda::KdaIntraBackwardOnHost(a, intra_backward_path.load() == KdaIntraBackwardPath::kKernelCodeOnHostReversed);
  }
  intra_backward_kernel_runs.fetch_add(1);
  return own;
}
// Whether the block code can write a segment's input gradients `out` (dq, dk, dv, dg, dbeta) where
// it reads q: dq, dk, dv in q's dtype, dg and dbeta fp32 or bf16, every row contiguous.
bool GradsOutTake(const std::vector<Tensor>& out, const Tensor& q) {
  for (size_t i = 0; i < out.size(); ++i) {
    const Tensor& t = out[i];
    const bool dtype = i < 3 ? t.scalar_type() == q.scalar_type() : KernelDtype(t);
    if (!dtype || t.device() != q.device() || (t.dim() == 4 && t.stride(3) != 1)) return false;
  }
  return true;
}

// The inter-chunk scan (spec 1.3 steps 3-4) of one segment's chunks, all (B, HV, n, ., .).
struct ScanResult {
  Tensor o;       // (B, HV, n, C, V) when asked for, unless the kernel wrote it into the caller's rows
  bool o_in_rows = false;  // the kernel wrote o into ScanForward's `o_rows`
  Tensor vt;      // (B, HV, n, C, V) the new values U - W S, with the states
  Tensor states;  // (B, HV, n, K, V) the state before each chunk, when asked for
  Tensor S;       // (B, HV, K, V) the state after the last chunk
};
// The reverse scan (spec 1.4 step 3) from dSN, the gradient of the state after the last chunk.
struct ReverseResult {
  Tensor dvt;  // (B, HV, n, C, V)
  Tensor dS;   // (B, HV, n, K, V) the gradient of the state after each chunk
  Tensor dS0;  // (B, HV, K, V) the gradient of the state before the first
};

// The libtorch loops, one step per chunk: the CPU path and the CUDA kernels' reference.
ScanResult ScanLoop(const Intra& in, const Tensor& h0, bool want_o, bool want_states) {
  const int64_t N = in.W.size(2);
  Tensor S = h0;  // (B, HV, K, V) the fp32/fp64 accumulator
  std::vector<Tensor> os, vts, states;
  for (int64_t c = 0; c < N; ++c) {
    if (want_states) states.push_back(S);
    Tensor vt = in.U.select(2, c) - in.W.select(2, c).matmul(S);  // (B, HV, C, V) new values
    if (want_states) vts.push_back(vt);
    if (want_o) os.push_back(in.qg.select(2, c).matmul(S) + in.Aqk.select(2, c).matmul(vt));
    S = in.eGC.select(2, c).unsqueeze(-1) * S + in.kg.select(2, c).transpose(-1, -2).matmul(vt);
  }
  ScanResult r;
  if (want_o) r.o = torch::stack(os, 2);
  if (want_states) r.vt = torch::stack(vts, 2), r.states = torch::stack(states, 2);
  r.S = S;
  return r;
}

ReverseResult ReverseLoop(const Intra& in, const Tensor& dO, const Tensor& P, const Tensor& dSN) {
  const int64_t N = in.W.size(2);
  Tensor dS = dSN;
  std::vector<Tensor> dvts(N), dSs(N);
  for (int64_t c = N - 1; c >= 0; --c) {
    dSs[c] = dS;
    Tensor dvt = P.select(2, c) + in.kg.select(2, c).matmul(dS);  // (B, HV, C, V)
    dvts[c] = dvt;
    dS = in.qg.select(2, c).transpose(-1, -2).matmul(dO.select(2, c)) + in.eGC.select(2, c).unsqueeze(-1) * dS -
         in.W.select(2, c).transpose(-1, -2).matmul(dvt);
  }
  return {torch::stack(dvts, 2), torch::stack(dSs, 2), dS};
}

// P_c = Aqk_c^T dO_c, the reverse scan's term that does not depend on the state gradient.
Tensor ReverseP(const Intra& in, const Tensor& dO) { return in.Aqk.transpose(-1, -2).matmul(dO); }

#ifdef ODYSSEY_KERNELS_CUDA
// qg, kg and W in bf16: IntraByKernel kept them so for the state scans.
bool Bf16Operands(const Intra& in) { return in.W.scalar_type() == torch::kBFloat16; }

bool KernelScans(const Intra& in) {
  const bool dtypes = in.W.scalar_type() == torch::kFloat32 ||
                      (Bf16Operands(in) && ScanTakesBf16Operands(in.W.size(0) * in.W.size(1), in.W.size(3),
                                                                 in.W.size(4), in.U.size(4)));
  return FusedKernelsEnabled() && in.W.is_cuda() && dtypes && in.W.size(0) * in.W.size(1) <= 65535 &&
         cuda::KdaScanSupported(in.W.size(3), in.W.size(4), in.U.size(4));
}

// Whether the tensor-core scan writes o straight into `rows` (B, HV, len, V) for BH = B x HV and
// len <= tokens (the segment's chunks): fp32 or bf16, each token's V values contiguous, tokens V
// apart, (batch, head) as one index.
bool ScanWritesRows(const Tensor& rows, int64_t BH, int64_t tokens, int64_t V) {
  return rows.defined() && scan_tensor_cores.load() && rows.is_cuda() && rows.dim() == 4 &&
         (rows.scalar_type() == torch::kFloat32 || rows.scalar_type() == torch::kBFloat16) &&
         rows.size(0) * rows.size(1) == BH && rows.size(2) <= tokens && rows.size(3) == V && rows.stride(3) == 1 &&
         rows.stride(2) == V && rows.stride(0) == rows.size(1) * rows.stride(1) &&
         reinterpret_cast<uintptr_t>(rows.data_ptr()) % 8 == 0;
}

ScanResult ScanKernel(const Intra& in, const Tensor& h0, bool want_o, bool want_states, const Tensor& o_rows) {
  const int64_t B = in.W.size(0), HV = in.W.size(1), N = in.W.size(2), C = in.W.size(3), K = in.W.size(4),
                V = in.U.size(4);
  c10::cuda::CUDAGuard guard(in.W.device());
  Tensor W = Dense(in.W), U = Dense(in.U), kg = Dense(in.kg), eGC = Dense(in.eGC), h = Dense(h0);
  Tensor qg = want_o ? Dense(in.qg) : Tensor(), Aqk = want_o ? Dense(in.Aqk) : Tensor();
  auto opts = U.options();
  ScanResult r;
  r.o_in_rows = want_o && ScanWritesRows(o_rows, B * HV, N * C, V);
  if (want_o && !r.o_in_rows) r.o = torch::empty({B, HV, N, C, V}, opts);
  // With bf16 operands the per-chunk states are kept in bf16 too: only the chunk gradients'
  // kernel reads them, as TF32 operands.
  if (want_states) {
    r.vt = torch::empty({B, HV, N, C, V}, opts);
    r.states = torch::empty({B, HV, N, K, V}, Bf16Operands(in) ? opts.dtype(torch::kBFloat16) : opts);
  }
  r.S = torch::empty({B, HV, K, V}, opts);
  // (bf16 storage for qg, kg and W under bf16_operands: the kernel reads their bits.)
  auto ptr = [](const Tensor& t) { return t.defined() ? static_cast<float*>(t.data_ptr()) : nullptr; };
  cuda::KdaScanForwardArgs a{ptr(W), ptr(U), ptr(kg), ptr(eGC), ptr(qg), ptr(Aqk), ptr(h),
                             ptr(r.o), ptr(r.vt), ptr(r.states), ptr(r.S), B * HV, N, C, K, V};
  a.tf32 = scan_tensor_cores.load();
  if (r.o_in_rows) {
    a.o_rows = o_rows.data_ptr();
    a.o_rows_bf16 = o_rows.scalar_type() == torch::kBFloat16;
    a.o_bh_stride = o_rows.stride(1);
    a.o_len = o_rows.size(2);
  }
  if (Bf16Operands(in)) {
    TORCH_CHECK(a.tf32, "kda scan forward: bf16 operands feed only the tensor-core scans");
    a.bf16_operands = true;
    a.value_block = want_o ? scan_value_block.load() : 32;  // 16-column blocks: with the output only
    bf16_operand_scans.fetch_add(1);
  }
  CheckKernelLaunch(cuda::KdaScanForward(a, Stream(W)), "kda scan forward");
  if (a.tf32) scan_tensor_core_launches.fetch_add(1);
  return r;
}

ReverseResult ReverseKernel(const Intra& in, const Tensor& dO, const Tensor& dSN) {
  const int64_t B = in.W.size(0), HV = in.W.size(1), N = in.W.size(2), C = in.W.size(3), K = in.W.size(4),
                V = in.U.size(4);
  c10::cuda::CUDAGuard guard(in.W.device());
  const bool tf32 = scan_tensor_cores.load();
  // The tensor-core kernel forms P from Aqk itself; the fp32 one reads it.
  Tensor W = Dense(in.W), kg = Dense(in.kg), eGC = Dense(in.eGC), qg = Dense(in.qg), dOd = Dense(dO),
         dSNd = Dense(dSN), Aqk = tf32 ? Dense(in.Aqk) : Tensor(), Pd = tf32 ? Tensor() : Dense(ReverseP(in, dOd));
  auto opts = eGC.options();  // fp32 (W may be bf16)
  // dS (per chunk) in bf16 with bf16 operands, as the forward's states.
  ReverseResult r{torch::empty({B, HV, N, C, V}, opts),
                  torch::empty({B, HV, N, K, V}, Bf16Operands(in) ? opts.dtype(torch::kBFloat16) : opts),
                  torch::empty({B, HV, K, V}, opts)};
  // (bf16 storage for qg, kg and W under bf16_operands: the kernel reads their bits.)
  auto ptr = [](const Tensor& t) { return t.defined() ? static_cast<float*>(t.data_ptr()) : nullptr; };
  cuda::KdaScanBackwardArgs a{ptr(W),     ptr(kg),   ptr(eGC),  ptr(qg),    ptr(dOd), ptr(Pd), ptr(dSNd),
                              ptr(r.dvt), ptr(r.dS), ptr(r.dS0), B * HV, N,        C,       K,         V};
  a.tf32 = tf32;
  a.Aqk = ptr(Aqk);
  if (Bf16Operands(in)) {
    TORCH_CHECK(tf32, "kda scan backward: bf16 operands feed only the tensor-core scans");
    a.bf16_operands = true;
    bf16_operand_scans.fetch_add(1);
  }
  CheckKernelLaunch(cuda::KdaScanBackward(a, Stream(W)), "kda scan backward");
  if (a.tf32) scan_tensor_core_launches.fetch_add(1);
  return r;
}
#endif

// `o_rows` (optional, with want_o): where o's rows go, (B, HV, len, V) with len <= n C; the
// tensor-core scan writes them there itself where it can (ScanResult::o_in_rows), in their dtype.
ScanResult ScanForward(const Intra& in, const Tensor& h0, bool want_o, bool want_states,
                       const Tensor& o_rows = Tensor()) {
#ifdef ODYSSEY_KERNELS_CUDA
  if (KernelScans(in)) return ScanKernel(in, h0, want_o, want_states, o_rows);
#endif
  return ScanLoop(in, h0, want_o, want_states);
}

ReverseResult ScanBackward(const Intra& in, const Tensor& dO, const Tensor& dSN) {
#ifdef ODYSSEY_KERNELS_CUDA
  if (KernelScans(in)) return ReverseKernel(in, dO, dSN);
#endif
  return ReverseLoop(in, dO, ReverseP(in, dO), dSN);
}

// The gradients of the chunk quantities given the forward states and the reverse scan's dS
// (spec 1.4): dq_g = dO h^T, dW = -dvt h^T, dk_g = vt dS^T, dA_qk = dO vt^T, d exp(G_C) =
// sum(h * dS) over V, batched over a segment's chunks.
struct ChunkGradsResult {
  Tensor dqg, dW, dkg, dAqk, deGC;
};
ChunkGradsResult ChunkGrads(const Intra& in, const ScanResult& f, const ReverseResult& r, const Tensor& dO) {
#ifdef ODYSSEY_KERNELS_CUDA
  // Where the scans ran on the tensor cores, one kernel (TF32 operands, as the scans'); otherwise
  // batched fp32 products.
  if (scan_tensor_cores.load() && KernelScans(in)) {
    const int64_t B = dO.size(0), HV = dO.size(1), N = dO.size(2), C = dO.size(3), K = f.states.size(3),
                  V = f.states.size(4);
    c10::cuda::CUDAGuard guard(dO.device());
    Tensor h = Dense(f.states), dS = Dense(r.dS), dOd = Dense(dO), vt = Dense(f.vt), dvt = Dense(r.dvt);
    auto opts = vt.options();  // fp32 (h and dS may be bf16)
    ChunkGradsResult g{torch::empty({B, HV, N, C, K}, opts), torch::empty({B, HV, N, C, K}, opts),
                       torch::empty({B, HV, N, C, K}, opts), torch::empty({B, HV, N, C, C}, opts),
                       torch::empty({B, HV, N, K}, opts)};
    TORCH_CHECK(h.scalar_type() == dS.scalar_type(),
                "kda chunk gradients: the states and their gradients differ in dtype");
    cuda::KdaChunkGradsArgs a{static_cast<float*>(h.data_ptr()), static_cast<float*>(dS.data_ptr()),
                              dOd.data_ptr<float>(),
                              vt.data_ptr<float>(),    dvt.data_ptr<float>(),   g.dqg.data_ptr<float>(),
                              g.dW.data_ptr<float>(),  g.dkg.data_ptr<float>(), g.dAqk.data_ptr<float>(),
                              g.deGC.data_ptr<float>(), B * HV,                 N,
                              C,                       K,                       V};
    a.bf16 = h.scalar_type() == torch::kBFloat16;
    CheckKernelLaunch(cuda::KdaChunkGrads(a, Stream(h)), "kda chunk gradients");
    scan_tensor_core_launches.fetch_add(1);
    return g;
  }
#endif
  Tensor hT = f.states.transpose(-1, -2);  // (B, HV, n, V, K)
  return {dO.matmul(hT), -r.dvt.matmul(hT), f.vt.matmul(r.dS.transpose(-1, -2)), dO.matmul(f.vt.transpose(-1, -2)),
          (f.states * r.dS).sum(-1)};
}

// One segment's inputs in the compute dtype, q and k expanded to the HV value heads, q scaled.
struct Segment {
  Tensor q, k, v, g, beta;
};
Segment Prepare(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                torch::ScalarType ct, int64_t HV, double scale) {
  return {ExpandHeads(q.to(ct), HV) * scale, ExpandHeads(k.to(ct), HV), v.to(ct), g.to(ct), beta.to(ct)};
}

// One segment's inputs as the caller gave them (narrowed, any float dtype, q unscaled with H
// heads), and their prepared form (Prepare), made only if something needs it. The chunk kernels
// read the caller's q, k, v and beta directly where they can (Direct()): each fp32 or bf16, q
// scaled as read; the prepared copies (four fp32 tensors of the segment, ~26 bytes of traffic an
// element for bf16 inputs) are then never made. libtorch paths, a cache for IntraBackward and
// HV > H take the prepared form.
class SegmentInputs {
 public:
  SegmentInputs() = default;
  SegmentInputs(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, torch::ScalarType ct, int64_t HV,
                double scale)
      : q(std::move(q)), k(std::move(k)), v(std::move(v)), g(std::move(g)), beta(std::move(beta)), scale(scale),
        ct_(ct), HV_(HV) {}
  // Whether the kernels may read the caller's q, k, v, beta: fp32 compute, q and k already with
  // HV heads, each fp32 or bf16 with contiguous rows (beta any strides).
  bool Direct() const {
    return direct_inputs.load() && !torch::GradMode::is_enabled() && ct_ == torch::kFloat32 && q.size(1) == HV_ &&
           KernelReadable(q, k, v, beta);
  }
  const Segment& Prepared() {
    if (!prepared_.q.defined()) prepared_ = Prepare(q, k, v, g, beta, ct_, HV_, scale);
    return prepared_;
  }
  // What the block code reads: the caller's tensors with q's scale (Direct()), else the prepared
  // ones (q already scaled).
  struct ForKernels {
    const Tensor &q, &k, &v, &beta;
    double q_scale;
  };
  ForKernels Kernels() {
    if (Direct()) return {q, k, v, beta, scale};
    const Segment& p = Prepared();
    return {p.q, p.k, p.v, p.beta, 1.0};
  }

  Tensor q, k, v, g, beta;
  double scale = 1.0;

 private:
  torch::ScalarType ct_ = torch::kFloat32;
  int64_t HV_ = 0;
  Segment prepared_;
};

// ComputeIntra over a segment's inputs: its kernels on the caller's tensors where they take them
// (no cache: IntraBackward's libtorch ops read the cache's chunked inputs in fp32), else
// ComputeIntra of the prepared form.
// `for_scans` and `keep_T` as IntraByKernel's (the libtorch form computes T either way).
Intra ComputeIntraFor(SegmentInputs& x, const Tensor& G, int64_t C, KdaGramForm form, IntraCache* cache = nullptr,
                      bool for_scans = false, bool keep_T = false) {
  if (cache == nullptr && x.Direct()) {
#ifdef ODYSSEY_KERNELS_CUDA
    Intra in;
    if (form == KdaGramForm::kWholeChunk &&
        IntraByKernel(x.q, x.k, x.v, G, x.beta, C, &in, nullptr, x.scale, for_scans, keep_T)) {
      direct_input_runs.fetch_add(1);
      return in;
    }
#endif
    if (form == KdaGramForm::kSubBlocks && BlockCodeTakes(x.q, x.k, x.v, x.beta, C)) {
      direct_input_runs.fetch_add(1);
      return SubBlockIntraByKernel(x.q, x.k, x.v, G, x.beta, C, x.scale);
    }
  }
  const Segment& p = x.Prepared();
  return ComputeIntra(p.q, p.k, p.v, G, p.beta, C, form, cache, for_scans, keep_T);
}

// Inputs as the caller gave them (q, k with H heads, any float dtype), h0 (B, HV, K, V) in the
// compute dtype. The sequence runs in segments of `segment` tokens (a multiple of C): all
// chunk-parallel work is batched over a segment's chunks, and the backward holds one segment's
// intermediates (its per-chunk states among them) at a time. Saved for backward: the inputs
// themselves (no copies) and the state entering each segment; the backward recomputes a
// segment's chunk quantities (spec 1.3's list, the UT inverse included), reruns its state scan
// from the saved entry state, runs the reverse scan and gets the parameter gradients of the
// chunk quantities as batched products, then the backward of the chunk-parallel graph: by hand
// (IntraBackward) for the whole-chunk Gram form, by autograd of the recomputed graph otherwise.
struct KdaChunkFunction : public torch::autograd::Function<KdaChunkFunction> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                               const Tensor& g, const Tensor& beta, const Tensor& h0, double scale, int64_t C,
                               int64_t segment) {
    const auto ct = h0.scalar_type();
    const int64_t T = q.size(2), HV = v.size(1);
    Tensor o = torch::empty(v.sizes(), v.options());
    Tensor S = h0;
    std::vector<Tensor> entry;
    // Each segment's Gram form: the backward recomputes the same G from the same g, so it takes
    // the form from here instead of reducing G again (a pass over G and a host sync a segment).
    std::vector<int64_t> forms;
    for (int64_t t0 = 0; t0 < T; t0 += segment) {
      const int64_t len = std::min(segment, T - t0);
      entry.push_back(S);
      SegmentInputs x(q.narrow(2, t0, len), k.narrow(2, t0, len), v.narrow(2, t0, len), g.narrow(2, t0, len),
                      beta.narrow(2, t0, len), ct, HV, scale);
      // (Profiler phases: user scopes, free when no profiler runs.)
      Intra in;
      {
        RECORD_USER_SCOPE("kda forward: intra");
        Tensor G = ChunkCumsum(x.g, C, ct);
        const KdaGramForm form = KdaDecayedGramForm(G);
        forms.push_back(static_cast<int64_t>(form));
        in = ComputeIntraFor(x, G, C, form, nullptr, /*for_scans=*/true);
      }
      RECORD_USER_SCOPE("kda forward: scan");
      Tensor rows = o.narrow(2, t0, len);
      ScanResult r = ScanForward(in, S, /*want_o=*/true, /*want_states=*/false, rows);
      if (!r.o_in_rows) rows.copy_(r.o.reshape({r.o.size(0), r.o.size(1), -1, r.o.size(-1)}).narrow(2, 0, len));
      S = r.S;
    }
    ctx->save_for_backward({q, k, v, g, beta, torch::stack(entry, 0)});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["C"] = C;
    ctx->saved_data["segment"] = segment;
    ctx->saved_data["forms"] = forms;
    return {o, S};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t C = ctx->saved_data["C"].toInt(), segment = ctx->saved_data["segment"].toInt();
    const std::vector<int64_t> forms = ctx->saved_data["forms"].toIntVector();
    const Tensor& entry = s[5];  // (segments, B, HV, K, V)
    const auto ct = entry.scalar_type();
    const int64_t T = s[0].size(2), H = s[0].size(1), HV = s[2].size(1);
    // Not zero-filled: every segment writes its whole slice of each gradient below (the by-hand
    // forms all five; the autograd form each one it gets, zeroing any it does not).
    variable_list dx;
    for (int i = 0; i < 5; ++i) dx.push_back(torch::empty_like(s[i]));
    Tensor dS = grads[1].defined() ? grads[1].to(ct) : torch::zeros_like(entry[0]);  // (B, HV, K, V)
    for (int64_t seg = entry.size(0) - 1; seg >= 0; --seg) {
      const int64_t t0 = seg * segment, len = std::min(segment, T - t0);
      // The whole-chunk Gram form (no chunk decays by more than 60 e-folds) and, where the
      // kernel's code runs, the sub-block form (no 16-row block does) are differentiated by hand
      // from a recompute without autograd (the kernel, or IntraBackward for the whole-chunk form
      // elsewhere); the others by autograd of the recomputed graph.
      variable_list leaves;
      Intra in;
      IntraCache cache;
      SegmentInputs x;  // the by-hand forms' inputs, kept for the kernel's backward
      Tensor G;
      bool by_hand = false, by_kernel = false, sub_blocks = false;
      bool read_T = false;  // the kernel reads the recompute's T (KdaIntraBackwardReadsInverse)
      {
        RECORD_USER_SCOPE("kda backward: intra recompute");
        torch::NoGradGuard no_grad;
        G = ChunkCumsum(s[3].narrow(2, t0, len), C, ct);
        const auto form = static_cast<KdaGramForm>(forms[seg]);  // the forward's: the same G
        sub_blocks = form == KdaGramForm::kSubBlocks;
        // Prepared here for the by-hand forms only: the autograd form prepares its own leaves.
        if (form == KdaGramForm::kWholeChunk || (sub_blocks && BlockCodeMayRun(s[0], ct))) {
          x = SegmentInputs(s[0].narrow(2, t0, len), s[1].narrow(2, t0, len), s[2].narrow(2, t0, len),
                            s[3].narrow(2, t0, len), s[4].narrow(2, t0, len), ct, HV, scale);
          const SegmentInputs::ForKernels kx = x.Kernels();
          by_kernel = BlockCodeTakes(kx.q, kx.k, kx.v, kx.beta, C);
        }
        by_hand = by_kernel || form == KdaGramForm::kWholeChunk;
        read_T = by_kernel && !sub_blocks && intra_backward_reads_inverse.load();
        if (by_hand) {
          // The kernel recomputes its factors itself: the recompute keeps nothing for it, and
          // only the scans read qg, kg and W (bf16 where the forward's scan read them so: the
          // states are recomputed from the operands the forward used); it reads T, the one
          // quantity whose recompute is serial (KdaIntraBackwardReadsInverse).
          in = ComputeIntraFor(x, G, C, form, by_kernel ? nullptr : &cache, /*for_scans=*/by_kernel,
                               /*keep_T=*/read_T);
        } else {
          for (int i = 0; i < 5; ++i) leaves.push_back(s[i].narrow(2, t0, len).detach().requires_grad_(true));
          torch::AutoGradMode enable(true);
          Segment xl = Prepare(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], ct, HV, scale);
          in = ComputeIntra(xl.q, xl.k, xl.v, ChunkCumsum(xl.g, C, ct), xl.beta, C, form);
        }
      }
      torch::NoGradGuard no_grad;
      at::RecordFunction scans(at::RecordScope::USER_SCOPE);
      if (scans.isActive()) scans.before("kda backward: scans and chunk gradients");
      ScanResult f = ScanForward(in, entry[seg], /*want_o=*/false, /*want_states=*/true);
      // Cast and laid out densely in one pass: the model hands a transposed view (its heads'
      // layout), which the scan and chunk-gradient kernels would otherwise each copy (Dense).
      Tensor dO = grads[0].defined() ? Chunk(grads[0].narrow(2, t0, len).to(ct, /*non_blocking=*/false, /*copy=*/false,
                                                                               c10::MemoryFormat::Contiguous),
                                             C)
                                     : torch::zeros_like(in.U);  // (B, HV, n, C, V)
      ReverseResult r = ScanBackward(in, dO, dS);
      // The gradients of the chunk quantities, batched over the segment's chunks.
      const ChunkGradsResult cg = ChunkGrads(in, f, r, dO);
      const Tensor &dqg = cg.dqg, &dW = cg.dW, &dkg = cg.dkg, &dAqk = cg.dAqk, &deGC = cg.deGC;
      scans.end();
      if (by_hand) {
        RECORD_USER_SCOPE("kda backward: intra by hand");
        // The segment's slices of the input gradients: where the kernel reads the caller's
        // inputs (q, k with the HV heads) it writes these itself, each element once.
        std::vector<Tensor> out;
        for (int i = 0; i < 5; ++i) out.push_back(dx[i].narrow(2, t0, len));
        IntraGrads d;            // what is left to copy into `out` (undefined where the kernel wrote it)
        bool dq_scaled = false;  // d.dq already times the scale
        if (by_kernel) {
          const SegmentInputs::ForKernels kx = x.Kernels();
          const bool direct_out = x.Direct() && GradsOutTake(out, kx.q);
          // dq leaves as the caller's q's gradient: times the scale either way (the prepared q
          // holds it, the direct one is scaled as read).
          d = IntraBackwardByKernel(kx.q, kx.k, kx.v, G, kx.beta, kx.q_scale, dqg, dkg, dW, r.dvt, dAqk, deGC, len,
                                    sub_blocks, scale, direct_out ? &out : nullptr,
                                    read_T ? in.T : Tensor());
          dq_scaled = true;
          if (x.Direct()) direct_input_runs.fetch_add(1);
          if (direct_out) direct_grad_runs.fetch_add(1);
        } else {
          d = IntraBackward(in, cache, dqg, dkg, dW, r.dvt, dAqk, deGC, len);
        }
        if (d.dq.defined()) {
          if (dq_scaled) {
            out[0].copy_(SumHeadRepeats(d.dq, H));
          } else {
            // Scaled in the compute dtype and stored in q's, one pass (the Tensor overload casts
            // to the output; the Scalar one wants the output in the compute dtype).
            at::mul_out(out[0], SumHeadRepeats(d.dq, H), at::scalar_tensor(scale, torch::kDouble));
          }
          out[1].copy_(SumHeadRepeats(d.dk, H));
          out[2].copy_(d.dv);
          out[3].copy_(d.dg);
          out[4].copy_(d.dbeta);
        }
      } else {
        RECORD_USER_SCOPE("kda backward: intra autograd");
        // WY, inverse, intra-chunk and cumsum backward (spec 1.4 steps 4-6) by autograd of the
        // chunk-parallel graph built above.
        variable_list d = torch::autograd::grad({in.qg, in.kg, in.W, in.U, in.Aqk, in.eGC}, leaves,
                                                {dqg, dkg, dW, r.dvt, dAqk, deGC}, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true);
        for (int i = 0; i < 5; ++i) {
          if (d[i].defined()) {
            dx[i].narrow(2, t0, len).copy_(d[i]);
          } else {
            dx[i].narrow(2, t0, len).zero_();
          }
        }
      }
      dS = r.dS0;
    }
    return {dx[0], dx[1], dx[2], dx[3], dx[4], dS, Tensor(), Tensor(), Tensor()};
  }
};

}  // namespace

void SetKdaIntraBackwardPath(KdaIntraBackwardPath path) { intra_backward_path.store(path); }
void SetKdaScanTensorCores(bool enabled) { scan_tensor_cores.store(enabled); }
bool KdaScanTensorCores() { return scan_tensor_cores.load(); }
int64_t KdaScanTensorCoreLaunches() { return scan_tensor_core_launches.load(); }
int64_t KdaIntraBackwardKernelRuns() { return intra_backward_kernel_runs.load(); }
int64_t KdaSubBlockForwardKernelRuns() { return sub_forward_kernel_runs.load(); }
int64_t KdaDirectInputRuns() { return direct_input_runs.load(); }
int64_t KdaDirectGradientRuns() { return direct_grad_runs.load(); }
void SetKdaDirectInputs(bool enabled) { direct_inputs.store(enabled); }
void SetKdaScanBf16Operands(bool enabled) { scan_bf16_operands.store(enabled); }
bool KdaScanBf16Operands() { return scan_bf16_operands.load(); }
bool SetKdaScanValueBlock(int columns) {
  if (columns != 16 && columns != 32) return false;
  scan_value_block.store(columns);
  return true;
}
int64_t KdaBf16OperandScans() { return bf16_operand_scans.load(); }
void SetKdaIntraBackwardReadsInverse(bool enabled) { intra_backward_reads_inverse.store(enabled); }
bool KdaIntraBackwardReadsInverse() { return intra_backward_reads_inverse.load(); }
int64_t KdaIntraBackwardInverseReads() { return inverse_reads.load(); }
int64_t KdaIntraElementLoadLaunches() { return intra_element_loads.load(); }

KdaGramForm KdaDecayedGramForm(const Tensor& G) {
  constexpr double kMaxDecay = 60.0;  // e-folds: exp(+-60) is finite and far from fp32's limits
  const int64_t C = G.size(-2);
  TORCH_CHECK(C % kSub == 0, "KdaDecayedGram: C (", C, ") must be a multiple of ", kSub);
  torch::NoGradGuard no_grad;
  Tensor Gb = G.detach().unflatten(-2, {C / kSub, kSub});
  // One reduction, one sync: the largest decay of a whole chunk and of a sub-block.
  Tensor d = torch::stack({(G.detach().select(-2, 0) - G.detach().select(-2, C - 1)).max(),
                           (Gb.select(-2, 0) - Gb.select(-2, kSub - 1)).max()})
                 .cpu();
  const double chunk = d[0].item<double>(), block = d[1].item<double>();
  if (chunk <= kMaxDecay) return KdaGramForm::kWholeChunk;
  return block <= kMaxDecay ? KdaGramForm::kSubBlocks : KdaGramForm::kElementwiseDiagonal;
}

namespace {
Tensor DecayedGram(const Tensor& x, const Tensor& y, const Tensor& G, bool strict, KdaGramForm form) {
  const int64_t C = x.size(-2);
  if (form == KdaGramForm::kWholeChunk) {
    Tensor G0 = G.narrow(-2, 0, 1);  // (..., 1, K)
    return LowerProduct(x * (G - G0).exp(), y * (G0 - G).exp(), strict);  // (..., C, C)
  }
  const int64_t nb = C / kSub;
  Tensor lower = LowerMask(C, strict, x.device());
  Tensor tri = lower.narrow(0, 0, kSub).narrow(1, 0, kSub);                // (16, 16)
  Tensor tri3 = tri.unsqueeze(-1);
  const bool diag_matmul = form == KdaGramForm::kSubBlocks;
  std::vector<Tensor> rows;
  for (int64_t bi = 0; bi < nb; ++bi) {
    const int64_t r0 = bi * kSub;
    Tensor xi = x.narrow(-2, r0, kSub), yi = y.narrow(-2, r0, kSub), Gi = G.narrow(-2, r0, kSub);
    // Every factor is taken against the block's first row r0: a row's entries then depend on no
    // later token, not even by rounding.
    Tensor Gr = G.narrow(-2, r0, 1);          // (..., 1, K)
    Tensor a = xi * (Gi - Gr).exp();          // (..., 16, K), exponents <= 0
    std::vector<Tensor> parts;
    if (diag_matmul) {
      // The keys before the block (exponents <= 0) and the block's own (>= 0, at most 60) in one
      // product, then masked.
      const int64_t n = r0 + kSub;
      Tensor b = y.narrow(-2, 0, n) * (Gr - G.narrow(-2, 0, n)).exp();  // (..., n, K)
      Tensor blk = a.matmul(b.transpose(-1, -2));                       // (..., 16, n)
      parts.push_back(torch::where(lower.narrow(0, r0, kSub).narrow(1, 0, n), blk, torch::zeros({}, blk.options())));
    } else {
      if (bi > 0) {
        Tensor b = y.narrow(-2, 0, r0) * (Gr - G.narrow(-2, 0, r0)).exp();  // (..., r0, K), exponents <= 0
        parts.push_back(a.matmul(b.transpose(-1, -2)));                     // (..., 16, r0)
      }
      // Element-wise; the exponent is masked to 0 above the diagonal before exp (it would be
      // positive there), then the product masked to 0.
      Tensor diff = Gi.unsqueeze(-2) - Gi.unsqueeze(-3);  // (..., 16, 16, K) [i, j] = G_i - G_j
      Tensor e = torch::where(tri3, diff, torch::zeros({}, diff.options())).exp() * tri3;
      parts.push_back((xi.unsqueeze(-2) * yi.unsqueeze(-3) * e).sum(-1));  // (..., 16, 16)
    }
    if (bi < nb - 1) {
      std::vector<int64_t> shape(xi.sizes().begin(), xi.sizes().end());
      shape.back() = C - r0 - kSub;
      parts.push_back(torch::zeros(shape, x.options()));
    }
    rows.push_back(torch::cat(parts, -1));
  }
  return torch::cat(rows, -2);
}
}  // namespace

Tensor KdaDecayedGram(const Tensor& x, const Tensor& y, const Tensor& G, bool strict) {
  return DecayedGram(x, y, G, strict, KdaDecayedGramForm(G));
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
  TORCH_CHECK(options.segment > 0 && options.segment % options.chunk_size == 0, "KDA: segment (", options.segment,
              ") must be a positive multiple of chunk_size (", options.chunk_size, ")");
  const auto ct = ComputeType(q, k, v, g);
  Tensor S0 = h0.defined() ? h0.to(ct) : torch::zeros({d.B, d.HV, d.K, d.V}, q.options().dtype(ct));
  variable_list out = KdaChunkFunction::apply(q, k, v, g, beta, S0, Scale(options, d.K), options.chunk_size,
                                              options.segment);
  return {out[0], out[1]};
}

}  // namespace odyssey::kernels
