#include "planner/planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace odyssey::planner {
namespace {

std::string GiB(int64_t b) { return absl::StrFormat("%.1f GiB", static_cast<double>(b) / (int64_t{1} << 30)); }

// Fixed allocator-visible overhead: cuBLAS/cuDNN workspaces, RoPE tables, small buffers.
constexpr int64_t kOverhead = int64_t{1} << 30;

}  // namespace

ModelShape ShapeOf(const model::ModelConfig& c) {
  ModelShape m;
  m.layers = c.num_hidden_layers;
  m.hidden = c.hidden_size;
  m.intermediate = c.intermediate_size;
  m.heads = c.num_attention_heads;
  m.kv_heads = c.num_key_value_heads;
  m.head_dim = c.HeadDim();
  m.vocab = c.vocab_size;
  m.params = c.NumParameters();
  m.largest = std::max({c.vocab_size * c.hidden_size, c.intermediate_size * c.hidden_size,
                        c.num_attention_heads * c.HeadDim() * c.hidden_size});
  m.qk_norm = c.QkNorm();
  return m;
}

std::string Strategy::Describe() const {
  std::string s = absl::StrCat("recompute=", recompute);
  if (recompute == "every_k") absl::StrAppend(&s, "(k=", every_k, ")");
  absl::StrAppend(&s, " offload=", offload ? "on" : "off");
  if (offload) absl::StrAppend(&s, "(device_resident=", device_resident, ")");
  absl::StrAppend(&s, " mlp_tile=", mlp_tile, " loss_tile=", loss_tile, " head_groups=", head_groups);
  if (optimizer_on_host) absl::StrAppend(&s, " optimizer_on_host");
  if (keep_attention) absl::StrAppend(&s, " keep_attention");
  return s;
}

Strategy StrategyOf(const std::string& recompute, int64_t every_k, bool offload, int64_t device_resident,
                    int64_t mlp_tile, int64_t loss_tile, int64_t head_groups, bool optimizer_on_host) {
  Strategy s;
  s.recompute = recompute;
  s.every_k = every_k;
  s.offload = offload;
  s.device_resident = device_resident;
  s.mlp_tile = mlp_tile;
  s.loss_tile = loss_tile;
  s.head_groups = std::max<int64_t>(1, head_groups);
  s.optimizer_on_host = optimizer_on_host;
  return s;
}

bool MemoryFields::AllSet() const {
  return !recompute.empty() && !offload.empty() && offload != "auto" && mlp_tile > 0 && loss_tile > 0;
}

Strategy ApplyMemoryFields(Strategy s, const MemoryFields& f) {
  if (!f.recompute.empty()) s.recompute = f.recompute;
  if (f.every_k > 0) s.every_k = f.every_k;
  if (f.offload == "on") s.offload = true;
  if (f.offload == "off") s.offload = false;
  if (f.mlp_tile > 0) s.mlp_tile = f.mlp_tile;
  if (f.loss_tile > 0) s.loss_tile = f.loss_tile;
  if (!s.offload) s.device_resident = 0;
  return s;
}

Prediction Predict(const Request& r) {
  const ModelShape& m = r.model;
  const Strategy& st = r.strategy;
  const int64_t e = r.param_bytes;
  const int64_t T = r.seq_len * r.batch_size;
  const int64_t H = m.hidden, I = m.intermediate, qd = m.heads * m.head_dim, kvd = m.kv_heads * m.head_dim;
  Prediction p;
  auto add = [&](const char* name, int64_t bytes) { p.terms.emplace_back(name, bytes); };

  // bf16: 2 + 2 + 4 + 4 + 4; fp32: 4 + 4 + (no master) + 4 + 4.
  const int64_t static_per_param = st.optimizer_on_host ? 2 * e : 16;
  add(st.optimizer_on_host ? "static (params, grads; optimizer state on the host)"
                           : "static (params, grads, fp32 master and moments)",
      m.params * static_per_param);
  const int64_t act = T * H * e;  // one (T, hidden) activation
  int64_t checkpoints = 0, on_gpu = 0;
  if (st.recompute == "layer") checkpoints = m.layers;
  if (st.recompute == "every_k") checkpoints = (m.layers + st.every_k - 1) / st.every_k;
  if (st.recompute != "none") {
    on_gpu = st.offload ? std::min(st.device_resident, checkpoints) : checkpoints;
    add("checkpointed layer inputs on the GPU", on_gpu * act);
    p.host_bytes = st.offload ? (checkpoints - on_gpu) * act : 0;
    if (st.offload) add("prefetched input of the next layer", act);
  }
  // One layer's backward: inputs kept by autograd for the attention half (layer input, norm
  // output, rotated q and k, v, attention output, residual output) and the MLP half (its
  // tiled Function keeps only its input), the attention kernel's fp32 log-sum-exp, and the
  // gradient buffers alive while the attention kernel's backward runs (incoming gradient,
  // dq/dk/dv of one head group, d(out)).
  const int64_t groups = std::max<int64_t>(1, st.head_groups);
  const int64_t saved_attention = T * (e * (3 * H + 2 * qd + 2 * kvd) + 4 * m.heads);
  const int64_t grads_attention = T * e * (2 * H + qd) + T * e * (qd + 2 * kvd) / groups;
  int64_t layer = saved_attention + grads_attention;
  if (st.mlp_tile > 0) {
    layer += std::min(st.mlp_tile, T) * I * e * 6;  // gate, up, act, product and their grads
  } else {
    layer += T * I * e * 6;
  }
  if (st.recompute == "none") {
    // Every layer's autograd state stays until backward reaches it.
    layer += (m.layers - 1) * (saved_attention + T * (e * (2 * H) + (st.mlp_tile > 0 ? 0 : I * e * 4)));
  }
  add("one layer's activations and gradients", layer);
  if (st.recompute == "every_k") add("inputs of the group being recomputed", (st.every_k - 1) * act);
  if (st.keep_attention && st.recompute == "layer") {
    add("kept attention outputs and log-sum-exp", m.layers * T * (qd * e + 4 * m.heads));
  }
  const int64_t loss_rows = st.loss_tile > 0 ? std::min(st.loss_tile, T) : T;
  add("final hidden state, its gradient, loss tile logits", 2 * act + loss_rows * m.vocab * 4 * 3);
  add("AdamW transients (largest parameter)", m.largest * 4 * 3);
  add("workspaces and small buffers", kOverhead);
  // The optimizer's transients come after the activations are gone: the peak is the larger of
  // the backward pass and the optimizer step.
  int64_t during_backward = 0;
  for (const auto& [name, bytes] : p.terms) {
    if (name.rfind("AdamW", 0) != 0) during_backward += bytes;
  }
  if (st.optimizer_on_host) p.host_bytes += m.params * 12;
  const int64_t during_step = m.params * static_per_param + kOverhead + m.largest * 4 * 3;
  p.gpu_peak_bytes = std::max(during_backward, during_step);
  p.fits = p.gpu_peak_bytes <= r.hardware.gpu_bytes && p.host_bytes <= r.hardware.host_bytes;
  return p;
}

std::string Prediction::Describe() const {
  std::string s = absl::StrCat("GPU peak ", GiB(gpu_peak_bytes), ", pinned host ", GiB(host_bytes), " (");
  for (size_t i = 0; i < terms.size(); ++i) absl::StrAppend(&s, i ? "; " : "", terms[i].first, " ", GiB(terms[i].second));
  return s + ")";
}

absl::StatusOr<Choice> Choose(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                              bool allow_keep_attention) {
  const int64_t T = seq_len * batch_size;
  Request base;
  base.model = model;
  base.seq_len = seq_len;
  base.batch_size = batch_size;
  base.hardware = hw;
  // Tiles: ~1 GiB of MLP intermediates, ~1.5 GiB of fp32 logits per tile.
  const int64_t mlp_tile = std::max<int64_t>(1024, (int64_t{1} << 30) / (model.intermediate * 2 * 6));
  const int64_t loss_tile = std::max<int64_t>(256, (int64_t{3} << 29) / (model.vocab * 4 * 3));
  std::vector<int64_t> group_options;
  for (int64_t g = 1; g <= model.kv_heads; ++g) {
    if (model.kv_heads % g == 0) group_options.push_back(g);
  }
  Choice best_miss;
  int64_t best_over = -1;
  auto consider = [&](Strategy s) -> bool {
    s.mlp_tile = T > mlp_tile ? mlp_tile : 0;
    s.loss_tile = T > loss_tile ? loss_tile : 0;
    for (int64_t g : group_options) {
      s.head_groups = g;
      Request r = base;
      r.strategy = s;
      Prediction p = Predict(r);
      if (p.fits) {
        best_miss = {s, p};
        return true;
      }
      const int64_t over = std::max(p.gpu_peak_bytes - hw.gpu_bytes, p.host_bytes - hw.host_bytes);
      if (best_over < 0 || over < best_over) {
        best_over = over;
        best_miss = {s, p};
      }
    }
    return false;
  };
  // 1. Recompute every layer, everything on the GPU.
  // 2. Offload, keeping as many checkpoints on the GPU as fit (more resident = fewer copies).
  // 3. Nested groups of k layers when the host cannot hold one input per layer.
  // 4. All of that again with the optimizer state on the host (costs ~24 bytes of PCIe
  //    traffic per parameter per step), for models whose state alone crowds the GPU.
  // 0. Keeping attention outputs (no attention re-forward), everything else on the GPU.
  if (allow_keep_attention) {
    Strategy keep = StrategyOf("layer", 2, false, 0, 0, 0, 1);
    keep.keep_attention = true;
    if (consider(keep)) return best_miss;
    keep.offload = true;
    if (consider(keep)) return best_miss;
  }
  for (bool host_optimizer : {false, true}) {
    if (consider(StrategyOf("layer", 2, false, 0, 0, 0, 1, host_optimizer))) return best_miss;
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{7}}) {
      const std::string mode = k == 1 ? "layer" : "every_k";
      const int64_t checkpoints = (model.layers + k - 1) / k;
      for (int64_t resident = checkpoints - 1; resident >= 0; --resident) {
        if (consider(StrategyOf(mode, std::max<int64_t>(k, 2), true, resident, 0, 0, 1, host_optimizer))) {
          return best_miss;
        }
      }
    }
  }
  return absl::ResourceExhaustedError(absl::StrCat(
      "does not fit: ", seq_len, " tokens x ", batch_size, " needs at least ", GiB(best_miss.prediction.gpu_peak_bytes),
      " of GPU memory and ", GiB(best_miss.prediction.host_bytes), " of pinned host memory with the best strategy (",
      best_miss.strategy.Describe(), "), over the machine's ", GiB(hw.gpu_bytes), " GPU / ", GiB(hw.host_bytes),
      " host by ", GiB(best_over)));
}

int64_t MaxSeqLen(const ModelShape& model, const Hardware& hw, int64_t granularity) {
  int64_t lo = 0, hi = granularity;
  while (Choose(model, hi, 1, hw).ok()) {
    lo = hi;
    hi *= 2;
    if (hi > (int64_t{1} << 34)) return lo;
  }
  while (hi - lo > granularity) {
    const int64_t mid = (lo + hi) / 2 / granularity * granularity;
    if (mid <= lo) break;
    if (Choose(model, mid, 1, hw).ok()) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace odyssey::planner
