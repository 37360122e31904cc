#include "worker/rl_calls.h"

#include <utility>

#include "common/wire_text.h"

namespace odyssey::worker {
namespace v1 = odyssey::v1;

namespace {

// The one copy of a batch across the seam: straight into the structs the engine reads.
std::vector<engine::Datum> ToBatch(const google::protobuf::RepeatedPtrField<v1::Datum>& batch) {
  std::vector<engine::Datum> out(static_cast<size_t>(batch.size()));
  for (int i = 0; i < batch.size(); ++i) {
    const v1::Datum& d = batch[i];
    engine::Datum& o = out[static_cast<size_t>(i)];
    o.tokens.assign(d.tokens().begin(), d.tokens().end());
    o.target_tokens.assign(d.target_tokens().begin(), d.target_tokens().end());
    o.weights.assign(d.weights().begin(), d.weights().end());
    o.sampler_logprobs.assign(d.sampler_logprobs().begin(), d.sampler_logprobs().end());
    o.advantages.assign(d.advantages().begin(), d.advantages().end());
  }
  return out;
}

void AddLogprobs(std::vector<std::vector<float>>& logprobs,
                 google::protobuf::RepeatedPtrField<v1::TokenLogprobs>* out) {
  out->Reserve(static_cast<int>(logprobs.size()));
  for (const std::vector<float>& l : logprobs) out->Add()->mutable_values()->Add(l.begin(), l.end());
}

}  // namespace

void AddPhases(const std::vector<engine::PhaseTime>& phases, google::protobuf::RepeatedPtrField<v1::PhaseSeconds>* out) {
  for (const engine::PhaseTime& p : phases) {
    v1::PhaseSeconds* ph = out->Add();
    ph->set_phase(ValidUtf8(p.kind));
    ph->set_count(p.count);
    ph->set_seconds(p.seconds);
  }
}

const char* CallName(const v1::TrainingCall& call) {
  switch (call.call_case()) {
    case v1::TrainingCall::kForwardBackward: return "forward_backward";
    case v1::TrainingCall::kOptimStep: return "optim_step";
    case v1::TrainingCall::kForward: return "forward";
    case v1::TrainingCall::kSaveCheckpoint: return "save_checkpoint";
    case v1::TrainingCall::kLoadCheckpoint: return "load_checkpoint";
    case v1::TrainingCall::kExportWeights: return "export_weights";
    case v1::TrainingCall::kSample: return "sample";
    default: return "unknown";
  }
}

RlRequest ToRlRequest(const v1::TrainingCall& call) {
  RlRequest r;
  r.weight_sum = call.weight_sum();
  r.datum_offset = call.datum_offset();
  switch (call.call_case()) {
    case v1::TrainingCall::kForwardBackward: {
      const v1::ForwardBackwardRequest& fb = call.forward_backward();
      r.method = RlMethod::kForwardBackward;
      r.batch = ToBatch(fb.batch());
      r.loss_kind = fb.loss().kind();
      r.clip_low = fb.loss().clip_low();
      r.clip_high = fb.loss().clip_high();
      break;
    }
    case v1::TrainingCall::kOptimStep: {
      const v1::AdamWParams& a = call.optim_step().adam();
      r.method = RlMethod::kOptimStep;
      r.lr = a.lr();
      r.beta1 = a.beta1();
      r.beta2 = a.beta2();
      r.eps = a.eps();
      r.weight_decay = a.weight_decay();
      break;
    }
    case v1::TrainingCall::kForward:
      r.method = RlMethod::kForward;
      r.batch = ToBatch(call.forward().batch());
      break;
    case v1::TrainingCall::kSaveCheckpoint:
      r.method = RlMethod::kSaveCheckpoint;
      r.directory = call.save_checkpoint().directory();
      break;
    case v1::TrainingCall::kLoadCheckpoint:
      r.method = RlMethod::kLoadCheckpoint;
      r.directory = call.load_checkpoint().directory();
      break;
    case v1::TrainingCall::kExportWeights:
      r.method = RlMethod::kExportWeights;
      r.directory = call.export_weights().directory();
      r.dtype = call.export_weights().dtype();
      break;
    case v1::TrainingCall::kSample: {
      const v1::SampleRequest& s = call.sample();
      const v1::SamplingParams& p = s.params();
      r.method = RlMethod::kSample;
      r.sample.prompts.reserve(static_cast<size_t>(s.prompts_size()));
      for (const v1::SamplePrompt& prompt : s.prompts()) r.sample.prompts.emplace_back(prompt.tokens().begin(), prompt.tokens().end());
      r.sample.num_samples = s.num_samples() == 0 ? 1 : s.num_samples();
      r.sample.max_tokens = p.max_tokens();
      r.sample.temperature = p.has_temperature() ? p.temperature() : 1.0;
      r.sample.top_p = p.top_p() == 0 ? 1.0 : p.top_p();
      r.sample.top_k = p.top_k();
      r.sample.stop_tokens.assign(p.stop_tokens().begin(), p.stop_tokens().end());
      r.sample.seed = p.seed();
      r.draw_seed = !p.has_seed();
      break;
    }
    default:
      break;
  }
  return r;
}

v1::TrainingReply ErrorReply(const v1::TrainingCall& call, const absl::Status& status) {
  v1::TrainingReply reply;
  reply.set_call_id(call.call_id());
  reply.set_job(call.job());
  reply.set_code(static_cast<int32_t>(status.code()));
  reply.set_message(WireText(status.message()));  // common/wire_text.h
  return reply;
}

v1::TrainingReply ToTrainingReply(const v1::TrainingCall& call, RlResponse&& r) {
  if (!r.status.ok()) return ErrorReply(call, r.status);
  v1::TrainingReply reply = ErrorReply(call, absl::OkStatus());
  switch (call.call_case()) {
    case v1::TrainingCall::kForwardBackward: {
      v1::ForwardBackwardResponse* fb = reply.mutable_forward_backward();
      AddLogprobs(r.logprobs, fb->mutable_logprobs());
      fb->set_loss(r.loss);
      fb->set_weight_sum(r.weight_sum);
      fb->set_mismatch_mean(r.mismatch_mean);
      fb->set_mismatch_max(r.mismatch_max);
      fb->set_mismatch_tokens(r.mismatch_tokens);
      fb->set_clipped_tokens(r.clipped_tokens);
      fb->set_tokens(r.tokens);
      fb->set_seconds(r.seconds);
      AddPhases(r.phases, fb->mutable_phases());
      break;
    }
    case v1::TrainingCall::kOptimStep:
      reply.mutable_optim_step()->set_step(r.step);
      reply.mutable_optim_step()->set_grad_norm(r.grad_norm);
      reply.mutable_optim_step()->set_lr(r.lr);
      AddPhases(r.phases, reply.mutable_optim_step()->mutable_phases());
      break;
    case v1::TrainingCall::kForward:
      AddLogprobs(r.logprobs, reply.mutable_forward()->mutable_logprobs());
      break;
    case v1::TrainingCall::kSaveCheckpoint:
      reply.mutable_save_checkpoint()->set_directory(r.directory);
      reply.mutable_save_checkpoint()->set_step(r.step);
      break;
    case v1::TrainingCall::kLoadCheckpoint:
      reply.mutable_load_checkpoint()->set_step(r.step);
      break;
    case v1::TrainingCall::kExportWeights:
      reply.mutable_export_weights()->set_directory(r.directory);
      break;
    case v1::TrainingCall::kSample: {
      v1::SampleResponse* s = reply.mutable_sample();
      s->mutable_sequences()->Reserve(static_cast<int>(r.sample.sequences.size()));
      for (const engine::SampledSequence& seq : r.sample.sequences) {
        v1::SampledSequence* o = s->add_sequences();
        o->set_prompt_index(static_cast<int32_t>(seq.prompt_index));
        o->mutable_tokens()->Add(seq.tokens.begin(), seq.tokens.end());
        o->mutable_logprobs()->Add(seq.logprobs.begin(), seq.logprobs.end());
        o->set_stop_reason(seq.stopped ? "stop" : "length");
      }
      s->set_seed(r.seed);
      s->set_tokens(r.sample.tokens);
      s->set_seconds(r.sample.seconds);
      break;
    }
    default:
      break;
  }
  return reply;
}

}  // namespace odyssey::worker
