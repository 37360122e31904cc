// The RL batch's validation without libtorch (this test links no torch): the whole-batch rules
// and a slice's, the whole-batch index in messages, and W. The full table of bad inputs runs
// through the trainer in rl_loss_test.
#include "engine/rl_datum.h"

#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace odyssey::engine {
namespace {

constexpr int64_t kVocab = 256;

Datum Sequence(int64_t first, size_t n) {
  Datum d;
  for (size_t i = 0; i < n; ++i) {
    d.tokens.push_back(first + static_cast<int64_t>(i));
    d.target_tokens.push_back(first + static_cast<int64_t>(i) + 1);
  }
  return d;
}

void ExpectInvalid(const absl::Status& s, const std::string& text) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(text), std::string::npos) << s;
}

TEST(RlDatumTest, WholeBatchAndSliceRules) {
  LossSpec ce;
  std::vector<Datum> batch = {Sequence(1, 3), Sequence(10, 4)};
  batch[1].weights = {0, 0.5f, 1, 1};
  EXPECT_TRUE(ValidateBatch(batch, &ce, kVocab, 16).ok());
  EXPECT_EQ(BatchWeightSum(batch), 3 + 2.5);

  // Empty: refused as a whole batch, allowed as a slice.
  ExpectInvalid(ValidateBatch({}, &ce, kVocab, 16), "batch: empty; at least one datum is required");
  ExpectInvalid(ValidateDatums({}, &ce, kVocab, 16, 0, /*allow_empty=*/false), "batch: empty");
  EXPECT_TRUE(ValidateDatums({}, &ce, kVocab, 16, 0, /*allow_empty=*/true).ok());
  // The loss comes first, even before emptiness.
  LossSpec bad_clip;
  bad_clip.kind = LossKind::kPpo;
  bad_clip.clip_low = 1.5;
  ExpectInvalid(ValidateBatch({}, &bad_clip, kVocab, 16), "loss.clip_low (1.5) must be in (0, 1)");

  // Weights summing to 0: the whole batch's rule only.
  for (Datum& d : batch) d.weights.assign(d.tokens.size(), 0.0f);
  ExpectInvalid(ValidateBatch(batch, &ce, kVocab, 16), "batch: the weights sum to 0 over the batch");
  EXPECT_TRUE(ValidateDatums(batch, &ce, kVocab, 16, 0, /*allow_empty=*/false).ok());
  EXPECT_TRUE(ValidateBatch(batch, nullptr, kVocab, 16).ok()) << "Forward has no weight rule";
}

TEST(RlDatumTest, MessagesNameTheWholeBatchIndexFieldAndRule) {
  LossSpec ppo;
  ppo.kind = LossKind::kPpo;
  std::vector<Datum> batch = {Sequence(1, 3), Sequence(10, 4)};
  for (Datum& d : batch) {
    d.sampler_logprobs.assign(d.tokens.size(), -1.0f);
    d.advantages.assign(d.tokens.size(), 0.5f);
  }
  EXPECT_TRUE(ValidateBatch(batch, &ppo, kVocab, 16).ok());
  batch[1].advantages.pop_back();
  ExpectInvalid(ValidateDatums(batch, &ppo, kVocab, 16, /*datum_offset=*/5, /*allow_empty=*/true),
                "batch[6].advantages: length (3) must equal the length of tokens (4)");
  batch[1].advantages.clear();
  ExpectInvalid(ValidateBatch(batch, &ppo, kVocab, 16), "batch[1].advantages: required by loss ppo (empty)");
  batch[0].tokens[2] = kVocab;
  ExpectInvalid(ValidateBatch(batch, &ppo, kVocab, 16), "batch[0].tokens[2] (256) must be in [0, 256)");
  ExpectInvalid(ValidateBatch({Sequence(1, 17)}, nullptr, kVocab, 16), "batch[0].tokens: length (17) must be <= 16");
}

TEST(RlDatumTest, LossKinds) {
  EXPECT_EQ(*ParseLossKind("importance_sampling"), LossKind::kImportanceSampling);
  ExpectInvalid(ParseLossKind("reinforce").status(), "loss.kind 'reinforce' is not a known loss");
  EXPECT_EQ(LossKindName(LossKind::kPpo), "ppo");
  LossSpec unspecified;
  unspecified.kind = LossKind::kUnspecified;
  ExpectInvalid(unspecified.Validate(), "loss.kind (unspecified) is not a known loss");
}

}  // namespace
}  // namespace odyssey::engine
