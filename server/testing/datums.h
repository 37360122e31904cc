// Test support: TrainingService batches of given lengths (rl_batch_test, session_ranks_test).
// Header-only.
#pragma once

#include <vector>

#include "odyssey/v1/odyssey.pb.h"

namespace odyssey::server::testing {

namespace v1 = odyssey::v1;

// A datum of `tokens` positions (token 1, target 2), with `weight` per token when not 0.
inline v1::Datum MakeDatum(int tokens, float weight = 0) {
  v1::Datum d;
  for (int i = 0; i < tokens; ++i) {
    d.add_tokens(1);
    d.add_target_tokens(2);
    if (weight != 0) d.add_weights(weight);
  }
  return d;
}

// One datum (MakeDatum, no weights) per length.
inline google::protobuf::RepeatedPtrField<v1::Datum> Batch(const std::vector<int>& lengths) {
  google::protobuf::RepeatedPtrField<v1::Datum> b;
  for (int n : lengths) *b.Add() = MakeDatum(n);
  return b;
}

}  // namespace odyssey::server::testing
