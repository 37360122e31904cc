// Trainer: one model, its optimizer and its data on one device; runs training steps.
//
// A step is forward + backward + clip + AdamW for one batch (one sequence or a packed batch),
// with the loss averaged over the batch's masked target tokens. Memory strategies plug in
// through set_layer_hook() (each decoder layer runs through the hook). Checkpoints are
// Hugging Face directories (config.json + model.safetensors) plus optimizer.safetensors and
// trainer_state.json, so a checkpoint both loads in transformers and resumes exactly.
// Thread safety: one thread at a time.
#pragma once

#include <memory>
#include <string>

#include <torch/types.h>

#include "absl/status/statusor.h"
#include "engine/data.h"
#include "engine/optimizer.h"
#include "model/causal_lm.h"

namespace odyssey::engine {

struct TrainerOptions {
  std::string model = "tiny";     // named shape or HF checkpoint directory
  std::string device = "auto";    // auto (cuda if present, else cpu) | cpu | cuda | cuda:N
  std::string dtype = "auto";     // auto (bfloat16 on cuda, float32 on cpu) | float32 | bfloat16
  std::string attention = "auto"; // attention backend: auto | math | sdpa
  uint64_t seed = 0;              // model init (named shapes) and data sampling
  int64_t steps = 300;            // training steps (> 0)
  double grad_clip = 1.0;         // max global grad norm; <= 0 disables
  AdamWOptions optimizer;
  ScheduleOptions schedule;       // total_steps 0 = `steps`
  DataOptions data;               // vocab_size is taken from the model
  absl::Status Validate() const;
};

struct StepResult {
  int64_t step = 0;          // steps completed after this one
  double loss = 0;           // mean over target tokens, nats
  double grad_norm = 0;      // before clipping
  double lr = 0;
  int64_t tokens = 0;        // positions processed (B * S)
  int64_t target_tokens = 0; // positions in the loss
  double seconds = 0;
  double tokens_per_second = 0;
};

class Trainer {
 public:
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(const TrainerOptions& options);

  // One step on the next batch of the trainer's data source.
  StepResult TrainStep();
  // One step on a given batch (CPU tensors; moved to the device here).
  StepResult Step(const Batch& batch);
  // Mean loss of `batch` without updating anything.
  double EvalLoss(const Batch& batch);

  absl::Status SaveCheckpoint(const std::string& dir);
  // Loads weights, optimizer state and the step counter written by SaveCheckpoint.
  absl::Status LoadCheckpoint(const std::string& dir);

  void set_layer_hook(model::LayerHook hook) { hook_ = std::move(hook); }
  int64_t step() const { return optimizer_->steps(); }
  model::CausalLM& model() { return model_; }
  DataSource& data() { return *data_; }
  torch::Device device() const { return device_; }
  torch::Dtype dtype() const { return dtype_; }
  const TrainerOptions& options() const { return options_; }

 private:
  Trainer(TrainerOptions options, model::CausalLM model, std::unique_ptr<DataSource> data, torch::Device device,
          torch::Dtype dtype);
  torch::Tensor Loss(const Batch& batch, int64_t* targets);

  TrainerOptions options_;
  model::CausalLM model_;
  std::unique_ptr<DataSource> data_;
  std::unique_ptr<AdamW> optimizer_;
  std::vector<torch::Tensor> params_;
  torch::Device device_;
  torch::Dtype dtype_;
  model::LayerHook hook_;
};

// "auto" | "cpu" | "cuda" | "cuda:N"; errors name the field and rule.
absl::StatusOr<torch::Device> ParseDevice(const std::string& name);

}  // namespace odyssey::engine
