// The planner: a memory model of odyssey's training step, in plain arithmetic (no libtorch), so
// the controller, the CLI and the benchmark link it as well as the worker.
//
// Predict() gives the peak GPU bytes (as libtorch's allocator counts them) and the pinned host
// bytes of one training step of a model at a sequence length under a strategy. Choose() picks
// the cheapest strategy that fits a machine, or says by how much nothing fits. Every term is
// listed in Prediction::terms so a mismatch against a measurement can be traced. The model:
//   static      16 bytes per parameter: bf16 param + bf16 grad + fp32 master + 2 fp32 moments
//               (fp32 training: 4 + 4 + 4 + 4, no master); 4 with the optimizer state on the
//               host, which then holds 12 bytes per parameter
//   checkpoints the saved layer inputs that stay on the GPU (T * hidden * 2 each)
//   layer       one decoder layer's activations and gradients during its backward recompute
//               (attention inputs/outputs saved by the kernel, per-group gradient buffers)
//   nested      with every_k: the other k-1 inputs of the group being recomputed
//   head/loss   final hidden state and its gradient, the loss tile's fp32 logits
//   optimizer   AdamW's transient fp32 buffers for the largest parameter
// Thread safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "model/config.h"

namespace odyssey::planner {

struct ModelShape {
  int64_t layers = 0, hidden = 0, intermediate = 0, heads = 0, kv_heads = 0, head_dim = 0, vocab = 0;
  int64_t params = 0;       // all parameters (tied embeddings once)
  int64_t largest = 0;      // elements of the largest parameter tensor
  bool qk_norm = false;
};
ModelShape ShapeOf(const model::ModelConfig& config);

struct Strategy {
  std::string recompute = "layer";  // none | layer | every_k
  int64_t every_k = 2;
  bool offload = false;
  int64_t device_resident = 0;  // with offload: checkpoints kept on the GPU
  int64_t mlp_tile = 0;         // 0 = untiled
  int64_t loss_tile = 0;        // 0 = untiled
  int64_t head_groups = 1;
  bool optimizer_on_host = false;  // fp32 master + moments in pinned host memory
  bool keep_attention = false;     // each layer's attention output + LSE kept on the GPU
  std::string Describe() const;
};
Strategy StrategyOf(const std::string& recompute, int64_t every_k, bool offload, int64_t device_resident,
                    int64_t mlp_tile, int64_t loss_tile, int64_t head_groups, bool optimizer_on_host = false);

// A job's memory fields (JobSpec.memory) over a strategy, the way workers apply them: what is
// set wins; recompute "", offload "" or "auto", every_k 0 and tiles 0 are unset. Offload off
// also drops the GPU-resident checkpoints.
struct MemoryFields {
  std::string recompute;
  int64_t every_k = 0;
  std::string offload;
  int64_t mlp_tile = 0, loss_tile = 0;
  // True when no field is left to the planner (recompute, offload and both tiles set).
  bool AllSet() const;
};
Strategy ApplyMemoryFields(Strategy base, const MemoryFields& fields);

struct Hardware {
  int64_t gpu_bytes = int64_t{136} << 30;   // what the allocator may use (H200: 139 GiB less context)
  int64_t host_bytes = int64_t{110} << 30;  // pinned memory the pool may take (128 GiB host)
};

struct Request {
  ModelShape model;
  int64_t seq_len = 0;
  int64_t batch_size = 1;
  Strategy strategy;
  Hardware hardware;
  int64_t param_bytes = 2;  // 2: bf16 params and activations; 4: fp32
};

struct Prediction {
  int64_t gpu_peak_bytes = 0;
  int64_t host_bytes = 0;
  bool fits = false;
  std::vector<std::pair<std::string, int64_t>> terms;  // the GPU peak, term by term
  std::string Describe() const;
};
Prediction Predict(const Request& request);

// The fastest strategy that fits (recompute every layer, offload only when needed, checkpoints
// kept on the GPU where room allows, nested groups only when host memory is short), with tile
// sizes and head groups chosen. An error says by how much the least-bad candidate misses.
struct Choice {
  Strategy strategy;
  Prediction prediction;
};
// allow_keep_attention: consider keeping attention outputs (fastest where it fits).
absl::StatusOr<Choice> Choose(const ModelShape& model, int64_t seq_len, int64_t batch_size, const Hardware& hardware,
                              bool allow_keep_attention = false);

// The longest sequence (a multiple of `granularity`) for which Choose() finds a strategy.
int64_t MaxSeqLen(const ModelShape& model, const Hardware& hardware, int64_t granularity = 16384);

}  // namespace odyssey::planner
