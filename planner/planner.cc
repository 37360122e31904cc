#include "planner/planner.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"

namespace odyssey::planner {
namespace {

std::string GiB(int64_t b) { return absl::StrFormat("%.1f GiB", static_cast<double>(b) / (int64_t{1} << 30)); }

// Fixed allocator-visible overhead: cuBLAS/cuDNN workspaces, RoPE tables, small buffers.
constexpr int64_t kOverhead = int64_t{1} << 30;

struct Search {
  Choice best;           // the first candidate that fits, else the one that misses by least
  bool fits = false;
  bool any_valid = false;  // some candidate was valid with the fixed fields on this model
  int64_t over = -1;     // by how much `best` misses (bytes; -1 when it fits)
};

// Why nothing fits when the planner was free: the least-bad candidate and by how much it misses.
std::string NothingFits(int64_t seq_len, int64_t batch_size, const Search& found, const Hardware& hw) {
  if (hw.cpu) {
    return absl::StrCat("does not fit: ", seq_len, " tokens x ", batch_size, " needs at least ",
                        GiB(found.best.prediction.gpu_peak_bytes + found.best.prediction.host_bytes),
                        " of host memory on a CPU worker with the best "
                        "strategy (", found.best.strategy.Describe(), "), over the ", GiB(hw.gpu_bytes),
                        " a CPU rank may use there by ", GiB(found.over));
  }
  return absl::StrCat("does not fit: ", seq_len, " tokens x ", batch_size, " needs at least ",
                      GiB(found.best.prediction.gpu_peak_bytes), " of GPU memory and ",
                      GiB(found.best.prediction.host_bytes), " of pinned host memory with the best strategy (",
                      found.best.strategy.Describe(), "), over the machine's ", GiB(hw.gpu_bytes), " GPU / ",
                      GiB(hw.host_bytes), " host by ", GiB(found.over));
}

// Why a strategy the job's fields decided (wholly or in part) does not fit.
std::string StrategyMisses(int64_t seq_len, int64_t batch_size, const MemoryStrategy& s, const Prediction& p,
                           const Hardware& hw) {
  if (hw.cpu) {
    return absl::StrCat("does not fit: the strategy needs ", GiB(p.gpu_peak_bytes + p.host_bytes),
                        " of host memory on a CPU "
                        "worker; a CPU rank may use ", GiB(hw.gpu_bytes), " there (", seq_len, " tokens x ",
                        batch_size, ", ", s.Describe(), ")");
  }
  return absl::StrCat("does not fit: the strategy needs ", GiB(p.gpu_peak_bytes), " of GPU memory and ",
                      GiB(p.host_bytes), " of pinned host memory; the machine has ", GiB(hw.gpu_bytes), " / ",
                      GiB(hw.host_bytes), " (", seq_len, " tokens x ", batch_size, ", ", s.Describe(), ")");
}

Request RequestFor(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                   int64_t param_bytes) {
  Request r;
  r.model = model;
  r.seq_len = seq_len;
  r.batch_size = batch_size;
  r.hardware = hw;
  r.param_bytes = param_bytes;
  return r;
}

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

Prediction Predict(const Request& r) {
  const ModelShape& m = r.model;
  const MemoryStrategy& st = r.strategy;
  const int64_t e = r.param_bytes;
  const int64_t T = r.seq_len * r.batch_size;
  const int64_t H = m.hidden, I = m.intermediate, qd = m.heads * m.head_dim, kvd = m.kv_heads * m.head_dim;
  Prediction p;
  auto add = [&](const char* name, int64_t bytes) { p.terms.emplace_back(name, bytes); };

  // bf16: 2 + 2 + 4 + 4 + 4; fp32: 4 + 4 + (no master) + 4 + 4. With the optimizer on the
  // host the GPU keeps only the params and grads (engine/host_adamw.h).
  const int64_t static_per_param = st.optimizer_on_host ? 2 * e : 16;
  add(st.optimizer_on_host ? "static (params, grads; optimizer state on the host)"
                           : "static (params, grads, fp32 master and moments)",
      m.params * static_per_param);
  const int64_t act = T * H * e;  // one (T, hidden) activation
  int64_t checkpoints = 0, on_gpu = 0;
  checkpoints = st.NumCheckpoints(m.layers);
  if (st.recompute != Recompute::kNone) {
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
  if (st.recompute == Recompute::kNone) {
    // Every layer's autograd state stays until backward reaches it.
    layer += (m.layers - 1) * (saved_attention + T * (e * (2 * H) + (st.mlp_tile > 0 ? 0 : I * e * 4)));
  }
  add("one layer's activations and gradients", layer);
  if (st.recompute == Recompute::kEveryK) add("inputs of the group being recomputed", (st.every_k - 1) * act);
  if (st.keep_attention && st.recompute == Recompute::kLayer) {
    add("kept attention outputs and log-sum-exp", m.layers * T * (qd * e + 4 * m.heads));
  }
  const int64_t loss_rows = st.loss_tile > 0 ? std::min(st.loss_tile, T) : T;
  add("final hidden state, its gradient, loss tile logits", 2 * act + loss_rows * m.vocab * 4 * 3);
  // On the device: the fp32 gradient, sqrt(v) and the denominator of the largest parameter. On
  // the host the update allocates nothing on the GPU; the gradient norm's fp32 copy remains.
  const int64_t step_transients = m.largest * 4 * (st.optimizer_on_host ? 1 : 3);
  add(st.optimizer_on_host ? "AdamW transients (gradient norm of the largest parameter; the update runs on the host)"
                           : "AdamW transients (largest parameter)",
      step_transients);
  add("workspaces and small buffers", kOverhead);
  // The optimizer's transients come after the activations are gone: the peak is the larger of
  // the backward pass and the optimizer step.
  int64_t during_backward = 0;
  for (const auto& [name, bytes] : p.terms) {
    if (name.rfind("AdamW", 0) != 0) during_backward += bytes;
  }
  // The host optimizer: fp32 master and moments (12 bytes per parameter, pageable) and the
  // pinned staging its copies go through (one buffer in the params' dtype: the gradient goes
  // down in it, the updated parameter comes back up in it).
  if (st.optimizer_on_host) p.host_bytes += m.params * (12 + e);
  const int64_t during_step = m.params * static_per_param + kOverhead + step_transients;
  p.gpu_peak_bytes = std::max(during_backward, during_step);
  // A CPU rank's "device" and "host" are one memory: what a spec's offload puts in the pool
  // counts against the same budget.
  p.fits = r.hardware.cpu ? p.gpu_peak_bytes + p.host_bytes <= r.hardware.gpu_bytes
                          : p.gpu_peak_bytes <= r.hardware.gpu_bytes && p.host_bytes <= r.hardware.host_bytes;
  return p;
}

std::string Prediction::Describe() const {
  std::string s = absl::StrCat("GPU peak ", GiB(gpu_peak_bytes), ", pinned host ", GiB(host_bytes), " (");
  for (size_t i = 0; i < terms.size(); ++i) absl::StrAppend(&s, i ? "; " : "", terms[i].first, " ", GiB(terms[i].second));
  return s + ")";
}

namespace {

// The candidates in order of speed; the first that fits, else the one that misses by least.
Search SearchStrategies(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                        const ChooseOptions& options) {
  const int64_t T = seq_len * batch_size;
  const Request base = RequestFor(model, seq_len, batch_size, hw, options.param_bytes);
  const MemoryFields& fixed = options.fixed;
  // Tiles: ~1 GiB of MLP intermediates, ~1.5 GiB of fp32 logits per tile.
  const int64_t mlp_tile = std::max<int64_t>(1024, (int64_t{1} << 30) / (model.intermediate * 2 * 6));
  const int64_t loss_tile = std::max<int64_t>(256, (int64_t{3} << 29) / (model.vocab * 4 * 3));
  std::vector<int64_t> group_options;
  for (int64_t g = 1; g <= model.kv_heads; ++g) {
    if (model.kv_heads % g == 0) group_options.push_back(g);
  }
  if (fixed.head_groups || group_options.empty()) group_options = {fixed.head_groups.value_or(1)};
  Search out;
  Choice& best_miss = out.best;
  int64_t& best_over = out.over;
  auto consider = [&](MemoryStrategy s) -> bool {
    s.mlp_tile = T > mlp_tile ? mlp_tile : 0;
    s.loss_tile = T > loss_tile ? loss_tile : 0;
    s.host_budget_bytes = hw.host_bytes;
    for (int64_t g : group_options) {
      s.head_groups = g;
      Request r = base;
      r.strategy = fixed.ApplyTo(s);
      if (!r.strategy.ValidateForModel(model.layers, model.kv_heads).ok()) continue;
      Prediction p = Predict(r);
      out.any_valid = true;
      if (p.fits) {
        best_miss = {r.strategy, p};
        out.fits = true;
        return true;
      }
      const int64_t over = hw.cpu ? p.gpu_peak_bytes + p.host_bytes - hw.gpu_bytes
                                  : std::max(p.gpu_peak_bytes - hw.gpu_bytes, p.host_bytes - hw.host_bytes);
      if (best_over < 0 || over < best_over) {
        best_over = over;
        best_miss = {r.strategy, p};
      }
    }
    return false;
  };
  auto candidate = [](Recompute recompute, int64_t every_k, bool offload, int64_t device_resident,
                      bool optimizer_on_host) {
    MemoryStrategy s;
    s.recompute = recompute;
    s.every_k = every_k;
    s.offload = offload;
    s.device_resident = device_resident;
    s.optimizer_on_host = optimizer_on_host;
    return s;
  };
  // 0. Keeping attention outputs (no attention re-forward), everything else on the GPU.
  // 1. Recompute every layer, everything on the GPU.
  // 2. Offload, keeping as many checkpoints on the GPU as fit (more resident = fewer copies).
  // 3. Nested groups of k layers when the host cannot hold one input per layer.
  // 4. All of that again with the optimizer state on the host (its update runs on CPU threads,
  //    overlapped with backward and the next forward but not wholly hidden; ~4 bytes of PCIe
  //    traffic per parameter per step), for models whose state alone crowds the GPU.
  if (hw.cpu) {
    // A CPU rank: host memory is its device, so there is nothing to offload to or put the
    // optimizer on. Plain autograd first (CPU memory is plentiful and recompute costs ~1.3x),
    // then recompute every layer, then nested groups.
    if (consider(candidate(Recompute::kNone, 2, false, 0, false))) return out;
    if (consider(candidate(Recompute::kLayer, 2, false, 0, false))) return out;
    for (int64_t k : {int64_t{2}, int64_t{3}, int64_t{4}, int64_t{7}}) {
      if (consider(candidate(Recompute::kEveryK, k, false, 0, false))) return out;
    }
    return out;
  }
  if (options.allow_keep_attention) {
    MemoryStrategy keep = candidate(Recompute::kLayer, 2, false, 0, false);
    keep.keep_attention = true;
    if (consider(keep)) return out;
    keep.offload = true;
    if (consider(keep)) return out;
  }
  for (bool host_optimizer : {false, true}) {
    if (consider(candidate(Recompute::kLayer, 2, false, 0, host_optimizer))) return out;
    for (int64_t k : {int64_t{1}, int64_t{2}, int64_t{3}, int64_t{4}, int64_t{7}}) {
      const Recompute mode = k == 1 ? Recompute::kLayer : Recompute::kEveryK;
      const int64_t checkpoints = (model.layers + k - 1) / k;
      for (int64_t resident = checkpoints - 1; resident >= 0; --resident) {
        if (consider(candidate(mode, std::max<int64_t>(k, 2), true, resident, host_optimizer))) return out;
      }
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<Choice> Choose(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hw,
                              const ChooseOptions& options) {
  const Search found = SearchStrategies(model, seq_len, batch_size, hw, options);
  if (!found.any_valid) {
    return absl::InvalidArgumentError(absl::StrCat("no strategy is valid with the job's memory fields for this model (",
                                                   options.fixed.ApplyTo({}).Describe(), ")"));
  }
  if (!found.fits) {
    return absl::ResourceExhaustedError(NothingFits(seq_len, batch_size, found, hw));
  }
  return found.best;
}

absl::StatusOr<JobPlan> PlanJob(const JobPlanRequest& q) {
  JobPlan plan;
  if (q.fields.AllSet()) {
    plan.strategy = q.fields.ApplyTo(MemoryStrategy{});
    if (plan.strategy.host_budget_bytes == 0) plan.strategy.host_budget_bytes = q.hardware.host_bytes;
    if (absl::Status s = plan.strategy.ValidateForModel(q.model.layers, q.model.kv_heads); !s.ok()) return s;
  } else {
    ChooseOptions options;
    options.fixed = q.fields;
    options.param_bytes = q.param_bytes;
    options.allow_keep_attention = q.allow_keep_attention;
    const Search found = SearchStrategies(q.model, q.seq_len, q.batch_size, q.hardware, options);
    if (!found.any_valid) {
      // Every candidate was refused by the fields: say why for the one the fields make of none.
      if (absl::Status s = q.fields.ApplyTo(MemoryStrategy{}).ValidateForModel(q.model.layers, q.model.kv_heads);
          !s.ok())
        return s;
      return absl::InvalidArgumentError("memory: no strategy is valid with the job's memory fields for this model");
    }
    if (!found.fits && !q.fields.AnySet()) {  // free to choose, and nothing fits
      plan.found = false;
      plan.message = NothingFits(q.seq_len, q.batch_size, found, q.hardware);
      return plan;
    }
    plan.strategy = found.best.strategy;
  }
  Request r = RequestFor(q.model, q.seq_len, q.batch_size, q.hardware, q.param_bytes);
  r.strategy = plan.strategy;
  plan.prediction = Predict(r);
  plan.fits = plan.prediction.fits;
  if (!plan.fits) plan.message = StrategyMisses(q.seq_len, q.batch_size, plan.strategy, plan.prediction, q.hardware);
  return plan;
}

absl::StatusOr<JobPlan> PlanModelJob(const std::string& model_name, const std::string& dtype, int64_t seq_len,
                                     int64_t batch_size, const MemoryFields& fields, const Hardware& hardware) {
  absl::StatusOr<model::ModelConfig> config = model::ResolveModelConfig(model_name);
  if (!config.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.model.name: ", config.status().message()));
  return PlanModelJob(*config, dtype, seq_len, batch_size, fields, hardware);
}

absl::StatusOr<JobPlan> PlanModelJob(const model::ModelConfig& config, const std::string& dtype, int64_t seq_len,
                                     int64_t batch_size, const MemoryFields& fields, const Hardware& hardware) {
  if (fields.head_groups && config.num_key_value_heads % *fields.head_groups != 0)
    return absl::InvalidArgumentError(absl::StrCat("spec.memory.attention_head_groups: (", *fields.head_groups,
                                                   ") must divide the model's num_key_value_heads (",
                                                   config.num_key_value_heads, ")"));
  if (fields.every_k && fields.recompute == Recompute::kEveryK && *fields.every_k > config.num_hidden_layers)
    return absl::InvalidArgumentError(absl::StrCat("spec.memory.recompute_every_k: (", *fields.every_k,
                                                   ") must be <= the model's num_hidden_layers (",
                                                   config.num_hidden_layers, ")"));
  JobPlanRequest q;
  q.model = ShapeOf(config);
  q.seq_len = seq_len;
  q.batch_size = std::max<int64_t>(1, batch_size);
  q.param_bytes = dtype == "float32" ? 4 : 2;
  q.fields = fields;
  q.hardware = hardware;
  absl::StatusOr<JobPlan> plan = PlanJob(q);
  if (!plan.ok()) return absl::InvalidArgumentError(absl::StrCat("spec.", plan.status().message()));
  return plan;
}

Hardware CpuHardware(int64_t host_memory_bytes, int64_t spec_budget_bytes) {
  Hardware h;
  h.gpu_bytes = UsableCpuBytes(host_memory_bytes, spec_budget_bytes);
  h.host_bytes = h.gpu_bytes;  // the same memory (Predict counts both against gpu_bytes)
  h.cpu = true;
  return h;
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
