// Ulysses attention on P thread-ranks equals one rank's attention on whole rows: outputs and
// the gradients of q, k, v (fp32, 1e-5), with GQA including fewer KV heads than ranks, packed
// documents, head-chunked rounds (the one-Function path and the per-round autograd path), and
// the kept-attention pair (CausalWithStats / CausalBackward) over shards.
#include "engine/parallel/ulysses.h"

#include <functional>
#include <thread>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "engine/parallel/communicator.h"

namespace odyssey::engine {
namespace {

struct Shape {
  int64_t P, Hq, Hkv;
};

// Whole-row inputs and the one-rank reference (math backend, autograd), fp32.
struct Reference {
  torch::Tensor q, k, v, w;     // (B, Hq, S, D), (B, Hkv, S, D) x2, (B, Hq, S, D) loss weights
  torch::Tensor out, dq, dk, dv;
};

constexpr int64_t kB = 2, kS = 36, kD = 8;  // S / P = 18 or 9 rows per rank

std::vector<std::vector<int64_t>> Docs() { return {{10, 17, 9}, {36}}; }  // whole rows; boundaries inside shards

Reference MakeReference(int64_t Hq, int64_t Hkv, const std::vector<std::vector<int64_t>>* docs) {
  at::Generator gen = at::detail::createCPUGenerator(7 + Hq * 10 + Hkv);
  Reference r;
  r.q = torch::randn({kB, Hq, kS, kD}, gen);
  r.k = torch::randn({kB, Hkv, kS, kD}, gen);
  r.v = torch::randn({kB, Hkv, kS, kD}, gen);
  r.w = torch::randn({kB, Hq, kS, kD}, gen);
  auto math = kernels::MakeAttentionBackend("math").value();
  torch::Tensor q = r.q.clone().requires_grad_(), k = r.k.clone().requires_grad_(), v = r.v.clone().requires_grad_();
  kernels::AttentionMeta meta;
  meta.doc_lens = docs;
  r.out = math->Forward(q, k, v, meta);
  (r.out * r.w).sum().backward();
  r.out = r.out.detach();
  r.dq = q.grad();
  r.dk = k.grad();
  r.dv = v.grad();
  return r;
}

torch::Tensor Shard(const torch::Tensor& t, int64_t rank, int64_t P) {
  const int64_t s = t.size(2) / P;
  return t.narrow(2, rank * s, s).contiguous();
}

void RunRanks(int64_t P, const std::function<void(Communicator&)>& fn) {
  auto group = InProcessGroup::Create(static_cast<int>(P), absl::Seconds(60));
  std::vector<std::unique_ptr<Communicator>> comms;
  for (int r = 0; r < P; ++r) comms.push_back(group->Rank(r));
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&fn, &c] { fn(*c); });
  for (auto& t : threads) t.join();
}

void ExpectClose(const torch::Tensor& got, const torch::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  const double err = (got - want).abs().max().item<double>();
  const double scale = std::max(1.0, want.abs().max().item<double>());
  EXPECT_LE(err, 1e-5 * scale) << what;
}

// Every rank's shard of the output and of the input gradients against the reference's.
void ExpectShardsEqualReference(const Shape& shape, int64_t head_chunk,
                                const std::vector<std::vector<int64_t>>* docs) {
  const Reference ref = MakeReference(shape.Hq, shape.Hkv, docs);
  const std::string name = ::testing::PrintToString(std::vector<int64_t>{shape.P, shape.Hq, shape.Hkv, head_chunk}) +
                           (docs ? " packed" : "");
  RunRanks(shape.P, [&](Communicator& comm) {
    const int64_t r = comm.rank();
    UlyssesAttention ulysses(kernels::MakeAttentionBackend("math").value(), comm, head_chunk);
    torch::Tensor q = Shard(ref.q, r, shape.P).requires_grad_();
    torch::Tensor k = Shard(ref.k, r, shape.P).requires_grad_();
    torch::Tensor v = Shard(ref.v, r, shape.P).requires_grad_();
    kernels::AttentionMeta meta;
    meta.doc_lens = docs;  // whole rows' documents
    torch::Tensor out = ulysses.Forward(q, k, v, meta);  // (B, Hq, S/P, D)
    (out * Shard(ref.w, r, shape.P)).sum().backward();
    const std::string at = name + " rank " + std::to_string(r);
    ExpectClose(out.detach(), Shard(ref.out, r, shape.P), at + " out");
    ExpectClose(q.grad(), Shard(ref.dq, r, shape.P), at + " dq");
    ExpectClose(k.grad(), Shard(ref.dk, r, shape.P), at + " dk");
    ExpectClose(v.grad(), Shard(ref.dv, r, shape.P), at + " dv");
  });
}

// P = 1, 2, 4 with MHA, GQA with KV heads >= P, = P and < P (replicated), and KV heads that
// P does not divide (6 on 4 ranks: lcm 12).
const std::vector<Shape> kShapes = {{1, 8, 2}, {2, 8, 8}, {2, 8, 2}, {2, 8, 1}, {4, 8, 4},
                                    {4, 8, 2}, {4, 8, 1}, {4, 12, 6}, {4, 4, 4}};

TEST(UlyssesTest, OutputAndGradientsEqualOneRank) {
  for (const Shape& s : kShapes) ExpectShardsEqualReference(s, /*head_chunk=*/0, nullptr);
}

TEST(UlyssesTest, PackedDocumentsAreSplitOnWholeRows) {
  const auto docs = Docs();
  for (const Shape& s : kShapes) ExpectShardsEqualReference(s, 0, &docs);
}

// UPipe rounds: chunks holding whole KV-head groups (G = 4, 8 with 4 queries per KV head) and
// chunks inside one group (G = 2: two rounds share a KV head, their dk/dv add up). Without
// documents the rounds run as one Function over the kernel's statistics; with documents as
// per-round autograd graphs. Both equal one rank, hence plain Ulysses.
TEST(UlyssesTest, HeadChunkedRoundsEqualOneRank) {
  const auto docs = Docs();
  for (const auto* d : {static_cast<const std::vector<std::vector<int64_t>>*>(nullptr), &docs}) {
    ExpectShardsEqualReference({2, 8, 2}, 2, d);
    ExpectShardsEqualReference({2, 8, 2}, 4, d);
    ExpectShardsEqualReference({2, 8, 2}, 8, d);
    ExpectShardsEqualReference({4, 8, 1}, 4, d);
    ExpectShardsEqualReference({4, 8, 2}, 4, d);
    ExpectShardsEqualReference({4, 12, 6}, 4, d);
    ExpectShardsEqualReference({1, 8, 2}, 2, d);
  }
}

// The chunked Function's all-to-all buffers are a round's: forward moves G/Hq of the heads per
// all-to-all. Measured by wrapping the communicator and recording each all-to-all's size.
class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int world_size() const override { return inner_.world_size(); }
  absl::StatusOr<torch::Tensor> AllToAll(const torch::Tensor& x, int64_t split_dim, int64_t concat_dim) override {
    largest_ = std::max<int64_t>(largest_, x.numel());
    ++calls_;
    return inner_.AllToAll(x, split_dim, concat_dim);
  }
  int64_t largest() const { return largest_; }
  int64_t calls() const { return calls_; }

 protected:
  absl::Status AllReduceFlat(torch::Tensor&, ReduceOp) override { return absl::UnimplementedError("not here"); }
  absl::Status BroadcastFlat(torch::Tensor&, int) override { return absl::UnimplementedError("not here"); }
  absl::Status AllToAllFlat(torch::Tensor&) override { return absl::UnimplementedError("not here"); }

 private:
  Communicator& inner_;
  int64_t largest_ = 0, calls_ = 0;
};

TEST(UlyssesTest, HeadChunkedAllToAllsMoveOneRoundOfHeads) {
  const Reference ref = MakeReference(8, 8, nullptr);
  for (int64_t chunk : {0, 2}) {
    RunRanks(2, [&](Communicator& comm) {
      CountingCommunicator counting(comm);
      UlyssesAttention ulysses(kernels::MakeAttentionBackend("math").value(), counting, chunk);
      torch::Tensor q = Shard(ref.q, comm.rank(), 2).requires_grad_();
      torch::Tensor k = Shard(ref.k, comm.rank(), 2).requires_grad_();
      torch::Tensor v = Shard(ref.v, comm.rank(), 2).requires_grad_();
      (ulysses.Forward(q, k, v, {}) * Shard(ref.w, comm.rank(), 2)).sum().backward();
      const int64_t all_heads = kB * 8 * (kS / 2) * kD;  // one (B, Hq, S/P, D) tensor
      EXPECT_EQ(counting.largest(), chunk == 0 ? all_heads : all_heads * 2 / 8) << "chunk " << chunk;
    });
  }
}

// The kept-attention pair over shards: the stats forward equals the reference output, and the
// backward kernel alone gives the reference gradients.
TEST(UlyssesTest, KeptAttentionPairEqualsOneRank) {
  for (const Shape& s : std::vector<Shape>{{2, 8, 2}, {4, 8, 1}, {4, 12, 6}}) {
    for (int64_t chunk : {int64_t{0}, s.P}) {
      const Reference ref = MakeReference(s.Hq, s.Hkv, nullptr);
      RunRanks(s.P, [&](Communicator& comm) {
        const int64_t r = comm.rank();
        UlyssesAttention ulysses(kernels::MakeAttentionBackend("math").value(), comm, chunk);
        ASSERT_TRUE(ulysses.SupportsStats(torch::kCPU));
        const torch::Tensor q = Shard(ref.q, r, s.P), k = Shard(ref.k, r, s.P), v = Shard(ref.v, r, s.P);
        const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
        auto [out, stats] = ulysses.CausalWithStats(q, k, v, scale);
        EXPECT_EQ(stats.lse.sizes(), (std::vector<int64_t>{kB, s.Hq, kS / s.P}));
        auto [dq, dk, dv] = ulysses.CausalBackward(Shard(ref.w, r, s.P), q, k, v, out, stats, scale);
        const std::string at =
            "P " + std::to_string(s.P) + " chunk " + std::to_string(chunk) + " rank " + std::to_string(r);
        ExpectClose(out, Shard(ref.out, r, s.P), at + " out");
        ExpectClose(dq, Shard(ref.dq, r, s.P), at + " dq");
        ExpectClose(dk, Shard(ref.dk, r, s.P), at + " dk");
        ExpectClose(dv, Shard(ref.dv, r, s.P), at + " dv");
      });
    }
  }
}

TEST(UlyssesTest, ValidationNamesBothNumbers) {
  auto message = [](absl::Status s) { return std::string(s.message()); };
  EXPECT_EQ(message(ValidateContextParallel(3, 0, 8, 2, 0)),
            "context_parallel (3) must divide num_attention_heads (8)");
  EXPECT_EQ(message(ValidateContextParallel(2, 0, 8, 2, 37)), "context_parallel (2) must divide data.seq_len (37)");
  EXPECT_EQ(message(ValidateContextParallel(4, 2, 8, 2, 0)),
            "context_parallel (4) must divide context_parallel.head_chunk (2)");
  EXPECT_EQ(message(ValidateContextParallel(2, 6, 12, 3, 0)),
            "context_parallel.head_chunk (6) must be a multiple or a divisor of the query heads per KV head (4)");
  EXPECT_EQ(message(ValidateContextParallel(2, 4, 6, 2, 0)),
            "context_parallel.head_chunk (4) must divide num_attention_heads (6)");
  EXPECT_TRUE(ValidateContextParallel(4, 4, 8, 1, 64).ok());
}

}  // namespace
}  // namespace odyssey::engine
