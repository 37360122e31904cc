#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "engine/loss.h"
#include "model/decode.h"

namespace odyssey::engine {

namespace {

absl::Status Invalid(absl::string_view field, absl::string_view rule) {
  return absl::InvalidArgumentError(absl::StrCat(field, " ", rule));
}

}  // namespace

absl::Status ValidateSample(const SampleSpec& spec, int64_t vocab, int64_t max_position_embeddings,
                            const SamplerLimits& limits) {
  if (spec.prompts.empty()) return Invalid("prompts", "must hold at least one prompt");
  if (spec.num_samples < 1) return Invalid("num_samples", absl::StrCat("(", spec.num_samples, ") must be >= 1"));
  if (spec.max_tokens < 1) return Invalid("params.max_tokens", absl::StrCat("(", spec.max_tokens, ") must be >= 1"));
  if (!std::isfinite(spec.temperature) || spec.temperature < 0) {
    return Invalid("params.temperature", absl::StrCat("(", spec.temperature, ") must be finite and >= 0 (0 = greedy)"));
  }
  if (!(spec.top_p > 0 && spec.top_p <= 1)) {
    return Invalid("params.top_p", absl::StrCat("(", spec.top_p, ") must be in (0, 1]"));
  }
  if (spec.top_k < 0) return Invalid("params.top_k", absl::StrCat("(", spec.top_k, ") must be >= 0 (0 = off)"));
  for (size_t i = 0; i < spec.stop_tokens.size(); ++i) {
    const int64_t t = spec.stop_tokens[i];
    if (t < 0 || t >= vocab) {
      return Invalid(absl::StrCat("params.stop_tokens[", i, "]"),
                     absl::StrCat("(", t, ") must be a token id in [0, ", vocab, ")"));
    }
  }
  int64_t longest = 0;
  for (size_t p = 0; p < spec.prompts.size(); ++p) {
    const std::vector<int64_t>& prompt = spec.prompts[p];
    if (prompt.empty()) return Invalid(absl::StrCat("prompts[", p, "]"), "must hold at least one token");
    for (size_t j = 0; j < prompt.size(); ++j) {
      if (prompt[j] < 0 || prompt[j] >= vocab) {
        return Invalid(absl::StrCat("prompts[", p, "][", j, "]"),
                       absl::StrCat("(", prompt[j], ") must be a token id in [0, ", vocab, ")"));
      }
    }
    const int64_t n = static_cast<int64_t>(prompt.size());
    if (n + spec.max_tokens > max_position_embeddings) {
      return Invalid(absl::StrCat("prompts[", p, "]"),
                     absl::StrCat("length (", n, ") + params.max_tokens (", spec.max_tokens,
                                  ") must be <= the model's max_position_embeddings (", max_position_embeddings, ")"));
    }
    longest = std::max(longest, n);
  }
  if (limits.max_positions > 0) {
    // Each factor is bounded above (max_position_embeddings), so the product cannot overflow
    // unless the counts are absurd; compare in double first.
    const double rows = static_cast<double>(spec.prompts.size()) * static_cast<double>(spec.num_samples);
    const double positions = rows * static_cast<double>(longest + spec.max_tokens);
    if (positions > static_cast<double>(limits.max_positions)) {
      return Invalid("prompts",
                     absl::StrCat("x num_samples x (longest prompt + params.max_tokens) (", spec.prompts.size(), " x ",
                                  spec.num_samples, " x ", longest + spec.max_tokens,
                                  ") must be <= the session's limit of ", limits.max_positions,
                                  " positions (spec.data.seq_len x spec.data.batch_size); split the request"));
    }
  }
  return absl::OkStatus();
}

torch::Tensor ChooseTokens(const torch::Tensor& logits, const SampleSpec& spec, at::Generator& generator) {
  torch::NoGradGuard no_grad;
  const torch::Tensor l = logits.to(torch::kCPU, torch::kFloat32);  // (R, V)
  if (spec.temperature == 0) return l.argmax(-1);
  const int64_t V = l.size(1);
  torch::Tensor z = l / spec.temperature;  // (R, V)
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (spec.top_k > 0 && spec.top_k < V) {
    torch::Tensor kth = std::get<0>(z.topk(spec.top_k, -1)).narrow(1, spec.top_k - 1, 1);  // (R, 1)
    z = z.masked_fill(z < kth, neg_inf);
  }
  if (spec.top_p < 1) {
    auto [sorted, order] = z.sort(-1, /*descending=*/true);  // (R, V) each
    torch::Tensor probs = sorted.softmax(-1);
    // A token goes when the mass of the tokens before it already reaches top_p: the first
    // token always stays.
    torch::Tensor drop_sorted = (probs.cumsum(-1) - probs) >= spec.top_p;  // (R, V) bool
    torch::Tensor drop = torch::zeros_like(drop_sorted).scatter(1, order, drop_sorted);
    z = z.masked_fill(drop, neg_inf);
  }
  torch::Tensor probs = z.softmax(-1).to(torch::kFloat64);  // (R, V)
  return torch::multinomial(probs, 1, /*replacement=*/false, generator).squeeze(1);
}

absl::StatusOr<SampleResult> Sample(model::CausalLM& model, const SampleSpec& spec, const SamplerLimits& limits) {
  const model::ModelConfig& config = model->config();
  if (absl::Status s = ValidateSample(spec, config.vocab_size, config.max_position_embeddings, limits); !s.ok())
    return s;
  const absl::Time start = absl::Now();
  torch::NoGradGuard no_grad;
  model->eval();
  const torch::Device device = model->HeadWeight().device();
  const int64_t P = static_cast<int64_t>(spec.prompts.size());
  const int64_t n = spec.num_samples;
  const int64_t R = P * n;
  int64_t longest = 0;
  for (const auto& p : spec.prompts) longest = std::max<int64_t>(longest, static_cast<int64_t>(p.size()));
  SampleResult result;
  try {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(spec.seed);
    model::KvCache cache = model::NewKvCache(*model, R, longest + spec.max_tokens);
    const torch::Tensor head = model->HeadWeight();  // (V, hidden)
    // Prefill: each prompt once, into its first row's cache; its other samples get copies.
    std::vector<torch::Tensor> last;  // per row, (hidden,) the next-token state
    std::vector<int64_t> lengths;     // per row, the prompt's length
    for (int64_t p = 0; p < P; ++p) {
      const std::vector<int64_t>& prompt = spec.prompts[static_cast<size_t>(p)];
      const int64_t L = static_cast<int64_t>(prompt.size());
      torch::Tensor ids = torch::tensor(prompt, torch::kInt64).to(device).unsqueeze(0);  // (1, L)
      model::KvCache row = model::CacheRows(cache, p * n, 1);
      torch::Tensor h = model::Prefill(*model, ids, row);  // (1, L, hidden); the views write through
      for (int64_t j = 1; j < n; ++j) model::CopyCacheRow(cache, p * n, p * n + j);
      for (int64_t j = 0; j < n; ++j) {
        last.push_back(h[0][L - 1]);
        lengths.push_back(L);
      }
    }
    torch::Tensor hidden = torch::stack(last);  // (R, hidden)
    torch::Tensor positions = torch::tensor(lengths, torch::kInt64).to(device);  // (R,) the next token's position
    result.sequences.resize(static_cast<size_t>(R));
    for (int64_t r = 0; r < R; ++r) result.sequences[static_cast<size_t>(r)].prompt_index = r / n;
    std::vector<bool> done(static_cast<size_t>(R), false);
    int64_t running = R;
    for (int64_t t = 0; t < spec.max_tokens && running > 0; ++t) {
      torch::Tensor logits = LogitsFp32(hidden, head);  // (R, V)
      torch::Tensor chosen = ChooseTokens(logits, spec, generator);                  // (R,) CPU
      torch::Tensor logp = logits.log_softmax(-1).gather(1, chosen.to(device).unsqueeze(1)).squeeze(1).cpu();  // (R,)
      const auto c = chosen.accessor<int64_t, 1>();
      const auto lp = logp.accessor<float, 1>();
      for (int64_t r = 0; r < R; ++r) {
        if (done[static_cast<size_t>(r)]) continue;
        SampledSequence& s = result.sequences[static_cast<size_t>(r)];
        s.tokens.push_back(c[r]);
        s.logprobs.push_back(lp[r]);
        ++result.tokens;
        if (std::find(spec.stop_tokens.begin(), spec.stop_tokens.end(), c[r]) != spec.stop_tokens.end()) {
          s.stopped = true;
          done[static_cast<size_t>(r)] = true;
          --running;
        } else if (static_cast<int64_t>(s.tokens.size()) == spec.max_tokens) {
          done[static_cast<size_t>(r)] = true;
          --running;
        }
      }
      if (running == 0) break;
      // Finished rows keep decoding (their tokens are dropped above): one batched step for all.
      hidden = model::Decode(*model, chosen.to(device).unsqueeze(1), positions, cache).squeeze(1);  // (R, hidden)
      positions = positions + 1;
    }
  } catch (const c10::Error& e) {
    const std::string what = absl::StrCat("sample failed: ", e.what_without_backtrace());
    if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return absl::ResourceExhaustedError(what);
    return absl::InternalError(what);
  }
  result.seconds = absl::ToDoubleSeconds(absl::Now() - start);
  return result;
}

}  // namespace odyssey::engine
