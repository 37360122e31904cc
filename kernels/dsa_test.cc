// DSA (kernels/dsa.h), spec 4's plan on the CPU: the chunked indexer's selection equals the naive
// one exactly (ties included: both follow the documented order), every selection obeys the rules
// (no future or duplicate item, count min(k, #visible), -1 only at the end, nothing better left
// out), pooled keys and their expansion, and sparse attention equals dense attention masked to the
// same key set (outputs and gradients), hence dense causal attention when k covers every key.
// Bars: fp64 against fp64 1e-12 (the same sums in another order: measured ~1e-16); fp32 sparse
// against the fp64 truth within twice the fp32 masked-dense error plus eight fp32 ulps at the
// tensor's scale (the house bar of kernels/README.md). Selections are compared exactly.
#include "kernels/dsa.h"

#include <cfloat>
#include <cmath>
#include <functional>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "kernels/attention.h"
#include "kernels/fused_ops.h"

namespace odyssey::kernels {
namespace {

using torch::Tensor;

struct Indexer {
  Tensor q, k, w;
};

Indexer MakeIndexer(int64_t B, int64_t HI, int64_t S, int64_t D, torch::ScalarType t, uint64_t seed) {
  torch::manual_seed(seed);
  return {torch::randn({B, HI, S, D}).to(t), torch::randn({B, S, D}).to(t), torch::randn({B, S, HI}).to(t)};
}

// Token indices of a pooled selection over S keys (top_k pools of 4, their tails), one query
// selecting nothing (DSA's selections as the tiled tests use them), fp64 indexer inputs from `seed`.
Tensor PooledIndices(int64_t B, int64_t S, int64_t top_k, uint64_t seed, int64_t empty_query) {
  Indexer ix = MakeIndexer(B, 2, S, 8, torch::kFloat64, seed);
  DsaIndexerOptions o;
  o.top_k = top_k;
  o.pool = 4;
  Tensor idx = ExpandPoolSelection(IndexerTopK(ix.q, torch::randn({B, S / 4, 8}, torch::kFloat64), ix.w, o));
  idx.select(1, empty_query).fill_(-1);
  return idx;
}

// A pool selection of one row of S queries written by hand: row t takes up to kp of the pools it
// sees (p <= (t + 1) / 4 - 1), pool(t, j, visible) for its j-th, valid entries first, then -1.
Tensor LongPoolSelection(int64_t S, int64_t kp, const std::function<int64_t(int64_t, int64_t, int64_t)>& pool) {
  Tensor pool_idx = torch::full({1, S, kp}, -1, torch::kInt32);
  auto w = pool_idx.accessor<int32_t, 3>();
  for (int64_t t = 0; t < S; ++t) {
    const int64_t visible = (t + 1) / 4;
    for (int64_t j = 0; j < std::min(kp, visible); ++j) w[0][t][j] = static_cast<int32_t>(pool(t, j, visible));
  }
  return pool_idx;
}

// Checks one selection against the scores it came from (B, S, P): the rules of dsa.h's file
// comment. Counts the rows checked into *rows (so a test can assert it looked at something).
void ExpectFollowsRule(const Tensor& sel, const Tensor& scores, int64_t top_k, int64_t pool, int64_t* rows) {
  const int64_t B = sel.size(0), S = sel.size(1), P = scores.size(2);
  auto a = sel.accessor<int32_t, 3>();
  Tensor sd = scores.to(torch::kFloat64);
  auto s = sd.accessor<double, 3>();
  *rows = 0;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < S; ++t, ++*rows) {
      const int64_t visible = std::min<int64_t>(P, (t + 1) / pool);
      const int64_t want = std::min(top_k, visible);
      std::set<int32_t> seen;
      for (int64_t j = 0; j < top_k; ++j) {
        const int32_t p = a[b][t][j];
        if (j >= want) {
          ASSERT_EQ(p, -1) << "row " << t << " slot " << j << ": padding expected";
          continue;
        }
        ASSERT_GE(p, 0) << "row " << t << " slot " << j;
        ASSERT_LE(pool * p + pool - 1, t) << "row " << t << ": future item " << p;
        ASSERT_TRUE(seen.insert(p).second) << "row " << t << ": duplicate " << p;
        if (j > 0) {  // the order: score descending, then index ascending
          const int32_t prev = a[b][t][j - 1];
          ASSERT_TRUE(s[b][t][prev] > s[b][t][p] || (s[b][t][prev] == s[b][t][p] && prev < p))
              << "row " << t << " slot " << j;
        }
      }
      if (want == 0) continue;
      const int32_t last = a[b][t][want - 1];
      for (int64_t p = 0; p < visible; ++p) {  // nothing better left out
        if (seen.count(p) != 0) continue;
        ASSERT_TRUE(s[b][t][p] < s[b][t][last] || (s[b][t][p] == s[b][t][last] && p > last))
            << "row " << t << ": item " << p << " should have been selected";
      }
    }
  }
}

TEST(DsaIndexer, ChunkedEqualsNaiveAndFollowsTheRule) {
  // fp64 and fp32 inputs, awkward block sizes (the last query and key blocks are partial),
  // top_k above and below the number of keys of late rows.
  struct Case {
    int64_t S, top_k, qb, kb;
    torch::ScalarType t;
  };
  for (const Case& c : {Case{300, 40, 64, 256, torch::kFloat64}, Case{257, 33, 37, 50, torch::kFloat64},
                        Case{97, 128, 16, 7, torch::kFloat32}, Case{200, 17, 200, 1000, torch::kFloat32}}) {
    Indexer x = MakeIndexer(2, 4, c.S, 32, c.t, 11);
    DsaIndexerOptions o;
    o.top_k = c.top_k;
    o.query_block = c.qb;
    o.key_block = c.kb;
    Tensor naive = IndexerTopKNaive(x.q, x.k, x.w, o), chunked = IndexerTopK(x.q, x.k, x.w, o);
    EXPECT_EQ(chunked.scalar_type(), torch::kInt32);
    EXPECT_EQ(chunked.sizes(), torch::IntArrayRef({2, c.S, c.top_k}));
    EXPECT_TRUE(torch::equal(naive, chunked)) << "S " << c.S << " top_k " << c.top_k;
    int64_t rows = 0;
    ExpectFollowsRule(chunked, IndexerScores(x.q, x.k, x.w), c.top_k, 1, &rows);
    EXPECT_EQ(rows, 2 * c.S);
    // -1 padding at the start of the sequence: row t < top_k holds exactly t + 1 keys.
    EXPECT_EQ(chunked[0][0][0].item<int32_t>(), 0);
    if (c.top_k > 1) {
      EXPECT_EQ(chunked[0][0][1].item<int32_t>(), -1);
    }
  }
}

// Exact ties everywhere: small integers make every score exact, so the selection is decided by
// the tie rule alone (lower index first), which both selections must apply identically.
TEST(DsaIndexer, TiesAreBrokenByLowerIndexInBothSelections) {
  torch::manual_seed(12);
  const int64_t S = 150;
  Tensor q = torch::randint(-1, 2, {1, 2, S, 8}).to(torch::kFloat32);
  Tensor k = torch::randint(0, 2, {1, S, 8}).to(torch::kFloat32);
  Tensor w = torch::ones({1, S, 2});
  DsaIndexerOptions o;
  o.top_k = 24;
  o.query_block = 13;
  o.key_block = 9;
  Tensor naive = IndexerTopKNaive(q, k, w, o), chunked = IndexerTopK(q, k, w, o);
  EXPECT_TRUE(torch::equal(naive, chunked));
  int64_t rows = 0;
  ExpectFollowsRule(chunked, IndexerScores(q, k, w), o.top_k, 1, &rows);
  EXPECT_EQ(rows, S);
  // All-equal scores: each row selects its first top_k keys in index order.
  Tensor flat = IndexerTopK(torch::zeros_like(q), k, w, o);
  EXPECT_EQ(flat[0][100][0].item<int32_t>(), 0);
  EXPECT_EQ(flat[0][100][23].item<int32_t>(), 23);
}

// Query tiles [t0, t1) of the sequence: the uneven tiles the tests split S queries into, the
// middle ones starting mid-pool (37 = 4 * 9 + 1) and after it.
std::vector<std::pair<int64_t, int64_t>> Tiles(int64_t S, std::vector<int64_t> starts) {
  std::vector<std::pair<int64_t, int64_t>> tiles;
  starts.push_back(S);
  for (size_t i = 0; i + 1 < starts.size(); ++i) tiles.emplace_back(starts[i], starts[i + 1]);
  return tiles;
}

// A query tile (q and w rows t0..t1-1, query_offset t0) against every key item selects exactly
// the whole sequence's rows t0..t1-1, in both selections, for pools of 4 (tiles starting inside
// a pool) and 1. Small-integer q, k and power-of-two w make every score exact in any order of
// summation, so a tile's different query and key blocks cannot move a score.
TEST(DsaIndexer, QueryTilesSelectTheWholeSequencesRows) {
  torch::manual_seed(16);
  const int64_t B = 2, HI = 3, S = 161, D = 16;
  Tensor q = torch::randint(-3, 4, {B, HI, S, D}).to(torch::kFloat64);
  Tensor w = torch::pow(2.0, torch::randint(-2, 1, {B, S, HI})).to(torch::kFloat64) *
             (torch::randint(0, 2, {B, S, HI}).to(torch::kFloat64) * 2 - 1);
  for (int64_t pool : {4, 1}) {
    Tensor k = torch::randint(-3, 4, {B, S / pool, D}).to(torch::kFloat64);
    DsaIndexerOptions o;
    o.top_k = pool == 4 ? 9 : 30;  // below the visible items of the late rows
    o.pool = pool;
    o.query_block = 16;
    o.key_block = 7;
    const Tensor whole = IndexerTopK(q, k, w, o), whole_naive = IndexerTopKNaive(q, k, w, o);
    ASSERT_TRUE(torch::equal(whole, whole_naive)) << "pool " << pool;
    int64_t rows = 0;
    for (const auto& [t0, t1] : Tiles(S, {0, 37, 100})) {
      DsaIndexerOptions tile = o;
      tile.query_offset = t0;
      const Tensor qt = q.narrow(2, t0, t1 - t0), wt = w.narrow(1, t0, t1 - t0);
      const Tensor got = IndexerTopK(qt, k, wt, tile), naive = IndexerTopKNaive(qt, k, wt, tile);
      ASSERT_EQ(got.sizes(), torch::IntArrayRef({B, t1 - t0, o.top_k}));
      EXPECT_TRUE(torch::equal(got, whole.narrow(1, t0, t1 - t0))) << "pool " << pool << " tile at " << t0;
      EXPECT_TRUE(torch::equal(naive, whole.narrow(1, t0, t1 - t0))) << "naive, pool " << pool << " tile at " << t0;
      rows += t1 - t0;
    }
    EXPECT_EQ(rows, S);
  }
  DsaIndexerOptions bad;
  bad.query_offset = -1;
  EXPECT_THROW(IndexerTopK(q, q.select(1, 0), w, bad), c10::Error);
}

// A long selection expands in blocks of rows: every row as written out by hand (its pools'
// tokens in selection order, then the tail, then -1), at the block boundaries and at random rows.
TEST(DsaIndexer, LongPoolSelectionExpandsRowByRow) {
  torch::manual_seed(15);
  const int64_t S = 40000, kp = 3;
  Tensor pool_idx = LongPoolSelection(S, kp, [](int64_t, int64_t j, int64_t visible) { return visible - 1 - 7 * j % visible; });
  auto w = pool_idx.accessor<int32_t, 3>();
  Tensor out = ExpandPoolSelection(pool_idx);
  ASSERT_EQ(out.sizes(), torch::IntArrayRef({1, S, 4 * kp + 3}));
  auto a = out.accessor<int32_t, 3>();
  std::vector<int64_t> rows = {0, 1, 2, 3, 4, 16382, 16383, 16384, 16385, 32767, 32768, 32769, S - 1};
  for (int i = 0; i < 200; ++i) rows.push_back(torch::randint(0, S, {1}).item<int64_t>());
  for (int64_t t : rows) {
    std::vector<int32_t> want;
    for (int64_t j = 0; j < kp && w[0][t][j] >= 0; ++j) {
      for (int32_t e = 0; e < 4; ++e) want.push_back(4 * w[0][t][j] + e);
    }
    for (int64_t u = 4 * ((t + 1) / 4); u <= t; ++u) want.push_back(static_cast<int32_t>(u));
    while (static_cast<int64_t>(want.size()) < 4 * kp + 3) want.push_back(-1);
    for (int64_t j = 0; j < 4 * kp + 3; ++j) ASSERT_EQ(a[0][t][j], want[static_cast<size_t>(j)]) << "row " << t << " slot " << j;
  }
}

// A tile's rows of a pool selection, given their first position t0, expand as the whole
// selection's rows do (the tail tokens follow the absolute position), short tiles (one block of
// rows, tiles starting inside a pool) and a long one crossing the 16384-row block boundary.
TEST(DsaIndexer, PoolSelectionTilesExpandAsTheWholeRows) {
  torch::manual_seed(17);
  const int64_t S = 40000, kp = 3;
  Tensor pool_idx = LongPoolSelection(S, kp, [](int64_t t, int64_t j, int64_t visible) { return (t * 7 + 5 * j) % visible; });
  const Tensor whole = ExpandPoolSelection(pool_idx);
  for (const auto& [t0, n] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 37}, {37, 63}, {101, 6}, {16000, 20000}, {S - 5, 5}}) {
    const Tensor got = ExpandPoolSelection(pool_idx.narrow(1, t0, n), t0);
    EXPECT_TRUE(torch::equal(got, whole.narrow(1, t0, n))) << "tile " << t0 << " + " << n;
  }
  EXPECT_THROW(ExpandPoolSelection(pool_idx, -1), c10::Error);
}

TEST(DsaIndexer, PooledKeysZeroGateIsMeanAndPoolSelectionCountsMatch) {
  torch::manual_seed(13);
  const int64_t B = 2, S = 203, D = 16;  // 50 complete pools and 3 tokens left over
  Tensor k = torch::randn({B, S, D}), z = torch::randn({B, S, D}), bias = torch::randn({4, D});
  Tensor mean = k.narrow(1, 0, 200).view({B, 50, 4, D}).mean(2);
  EXPECT_TRUE(torch::allclose(KeyPool4(k, torch::zeros_like(z), torch::zeros_like(bias)), mean, 1e-6, 1e-6));
  Tensor pooled = KeyPool4(k, z, bias);  // (B, 50, D)
  ASSERT_EQ(pooled.sizes(), torch::IntArrayRef({B, 50, D}));
  // One pool by hand: softmax over the 4 slots per channel.
  Tensor wts = torch::softmax(z[1].narrow(0, 8, 4) + bias, 0);
  EXPECT_TRUE(torch::allclose(pooled[1][2], (wts * k[1].narrow(0, 8, 4)).sum(0), 1e-6, 1e-6));

  Indexer x = MakeIndexer(B, 4, S, D, torch::kFloat32, 14);
  DsaIndexerOptions o;
  o.top_k = 12;
  o.pool = 4;
  o.query_block = 29;
  o.key_block = 5;
  Tensor naive = IndexerTopKNaive(x.q, pooled, x.w, o), chunked = IndexerTopK(x.q, pooled, x.w, o);
  EXPECT_TRUE(torch::equal(naive, chunked));
  int64_t rows = 0;
  ExpectFollowsRule(chunked, IndexerScores(x.q, pooled, x.w), o.top_k, 4, &rows);
  EXPECT_EQ(rows, B * S);
  Tensor tokens = ExpandPoolSelection(chunked);  // (B, S, 4 * 12 + 3)
  ASSERT_EQ(tokens.sizes(), torch::IntArrayRef({B, S, 51}));
  auto a = tokens.accessor<int32_t, 3>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < S; ++t) {
      const int64_t want = 4 * std::min<int64_t>(12, (t + 1) / 4) + (t + 1) % 4;
      std::set<int32_t> seen;
      for (int64_t j = 0; j < 51; ++j) {
        if (j >= want) {
          ASSERT_EQ(a[b][t][j], -1) << t << " " << j;
          continue;
        }
        ASSERT_GE(a[b][t][j], 0) << t << " " << j;
        ASSERT_LE(a[b][t][j], t) << "future token at row " << t;
        ASSERT_TRUE(seen.insert(a[b][t][j]).second) << "duplicate at row " << t;
      }
      for (int64_t u = (t + 1) / 4 * 4; u <= t; ++u) ASSERT_EQ(seen.count(u), 1u) << "tail " << u << " of row " << t;
    }
  }
}

// Dense attention over the keys the indices name, in the indices' dtype-free form: a (B, S, S)
// mask, fp64-or-input-dtype softmax. GQA by expanding k, v.
Tensor MaskedDense(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& idx) {
  const int64_t B = q.size(0), H = q.size(1), S = q.size(2), G = H / k.size(1);
  Tensor il = idx.to(torch::kLong);
  Tensor mask = torch::zeros({B, S, S + 1}, torch::kBool);
  mask.scatter_(-1, torch::where(il >= 0, il, torch::full({}, S, il.options())), true);  // slot S: -1
  mask = mask.narrow(-1, 0, S).unsqueeze(1);  // (B, 1, S, S)
  Tensor ke = k.repeat_interleave(G, 1), ve = v.repeat_interleave(G, 1);
  Tensor s = q.matmul(ke.transpose(-1, -2)) / std::sqrt(double(q.size(3)));
  return torch::softmax(s.masked_fill(mask.logical_not(), -INFINITY), -1).matmul(ve);
}

struct Qkv {
  Tensor q, k, v;
};
Qkv MakeQkv(int64_t B, int64_t H, int64_t Hkv, int64_t S, int64_t D, int64_t Dv, uint64_t seed) {
  torch::manual_seed(seed);
  auto o = torch::TensorOptions().dtype(torch::kFloat64);
  return {torch::randn({B, H, S, D}, o), torch::randn({B, Hkv, S, D}, o), torch::randn({B, Hkv, S, Dv}, o)};
}

std::vector<Tensor> RunAttention(bool sparse, const Qkv& x, const Tensor& idx, const Tensor& dO, int64_t qblock = 128,
                                 int64_t pairs = int64_t{1} << 27) {
  Tensor q = x.q.clone().requires_grad_(), k = x.k.clone().requires_grad_(), v = x.v.clone().requires_grad_();
  Tensor o = sparse ? SparseAttention(q, k, v, idx, 0.0, qblock, pairs) : MaskedDense(q, k, v, idx);
  (o.to(dO.scalar_type()) * dO).sum().backward();
  return {o.detach(), q.grad(), k.grad(), v.grad()};
}

const char* kNames[] = {"o", "dq", "dk", "dv"};

double MaxErr(const Tensor& a, const Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

TEST(DsaSparseAttention, EqualsMaskedDenseAttentionFp64) {
  const int64_t B = 2, H = 4, Hkv = 2, S = 97, D = 16, Dv = 12;
  Qkv x = MakeQkv(B, H, Hkv, S, D, Dv, 21);
  Indexer ix = MakeIndexer(B, 2, S, 8, torch::kFloat64, 22);
  DsaIndexerOptions o;
  o.top_k = 20;  // fewer than the causal keys of most rows: a real selection, -1 in rows < 19
  Tensor idx = IndexerTopK(ix.q, ix.k, ix.w, o);
  Tensor dO = torch::randn({B, H, S, Dv}, torch::kFloat64);
  std::vector<Tensor> ref = RunAttention(false, x, idx, dO);
  for (int64_t qblock : {128, 7}) {
    std::vector<Tensor> got = RunAttention(true, x, idx, dO, qblock);
    for (int i = 0; i < 4; ++i) {
      EXPECT_LT(MaxErr(got[i], ref[i]), 1e-12) << kNames[i] << " qblock " << qblock;
    }
  }
  // Where the selection differs from causal attention (so the test sees the mask).
  Tensor all = IndexerTopK(ix.q, ix.k, ix.w, [] { DsaIndexerOptions a; a.top_k = 97; return a; }());
  EXPECT_GT(MaxErr(RunAttention(true, x, all, dO)[0], ref[0]), 1e-3);
}

// The largest difference over the reference's largest magnitude.
double RelErr(const Tensor& got, const Tensor& want) {
  return MaxErr(got, want) / want.abs().max().item<double>();
}

// A caller running its own backward tile by tile (model/hybrid.cc's sparse stage): each tile's
// queries and indices against the whole sequence's keys through SparseAttentionForward and
// SparseAttentionBackward, dk and dv summed into one pair of accumulators, equal autograd of the
// whole SparseAttention (fp64; three uneven tiles, query blocks that divide none of them, pool
// selections with their tails, a query without keys), and lse is the log-sum-exp of the masked
// scaled scores. Neither function builds a graph.
TEST(DsaSparseAttention, TilesThroughForwardAndBackwardEqualTheWholeFp64) {
  const int64_t B = 2, H = 6, Hkv = 2, S = 157, D = 16, Dv = 12;
  Qkv x = MakeQkv(B, H, Hkv, S, D, Dv, 81);
  Tensor idx = PooledIndices(B, S, 6, 82, /*empty_query=*/60);
  Tensor dO = torch::randn({B, H, S, Dv}, torch::kFloat64);
  const std::vector<Tensor> want = RunAttention(true, x, idx, dO);

  auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  Tensor out = torch::empty({B, H, S, Dv}, f64), lse = torch::empty({B, H, S}, f64), dq = torch::empty({B, H, S, D}, f64);
  Tensor dk = torch::zeros({B, Hkv, S, D}, f64), dv = torch::zeros({B, Hkv, S, Dv}, f64);
  const Tensor qg = x.q.clone().requires_grad_();  // a graph would start here if one were built
  for (const auto& [t0, t1] : Tiles(S, {0, 50, 61})) {
    const int64_t n = t1 - t0;
    const Tensor qt = qg.narrow(2, t0, n), it = idx.narrow(1, t0, n);
    const SparseAttentionResult r = SparseAttentionForward(qt, x.k, x.v, it, 0.0, 17);
    ASSERT_EQ(r.out.sizes(), torch::IntArrayRef({B, H, n, Dv}));
    ASSERT_EQ(r.lse.sizes(), torch::IntArrayRef({B, H, n}));
    EXPECT_EQ(r.lse.scalar_type(), torch::kFloat64);
    EXPECT_FALSE(r.out.requires_grad());
    out.narrow(2, t0, n).copy_(r.out);
    lse.narrow(2, t0, n).copy_(r.lse);
    const Tensor dqt = SparseAttentionBackward(dO.narrow(2, t0, n), qt, x.k, x.v, it, r.lse, 0.0, dk, dv, 17);
    EXPECT_FALSE(dqt.requires_grad());
    dq.narrow(2, t0, n).copy_(dqt);
  }
  const std::vector<Tensor> got{out, dq, dk, dv};
  for (int i = 0; i < 4; ++i) EXPECT_LT(RelErr(got[i], want[i]), 1e-10) << kNames[i];

  Tensor il = idx.to(torch::kLong);
  Tensor sel = torch::zeros({B, S, S + 1}, torch::kBool).scatter_(2, torch::where(il >= 0, il, S), true).narrow(2, 0, S);
  Tensor sc = x.q.matmul(x.k.repeat_interleave(H / Hkv, 1).transpose(2, 3)) / std::sqrt(double(D));
  Tensor ref = torch::logsumexp(sc.masked_fill(sel.unsqueeze(1).logical_not(), -INFINITY), -1);  // (B, H, S)
  Tensor finite = torch::isfinite(ref);
  EXPECT_TRUE(torch::equal(torch::isfinite(lse), finite));
  EXPECT_EQ(finite.logical_not().sum().item<int64_t>(), B * H);  // query 60 of each (b, h) only
  EXPECT_TRUE((lse.select(2, 60) == -INFINITY).all().item<bool>());
  EXPECT_LT(MaxErr(lse.masked_select(finite), ref.masked_select(finite)), 1e-12);
}

// q the last rows of a longer sequence (Sq < Sk), its indices into all Sk keys: the whole call's
// rows, and with the upstream gradient zero outside those rows, the whole call's dq rows and dk,
// dv (fp64).
TEST(DsaSparseAttention, QueriesOfALongerSequenceEqualTheWholeRowsFp64) {
  const int64_t B = 2, H = 4, Hkv = 1, S = 120, D = 16, Dv = 8, t0 = 83, n = S - t0;
  Qkv x = MakeQkv(B, H, Hkv, S, D, Dv, 91);
  Indexer ix = MakeIndexer(B, 2, S, 8, torch::kFloat64, 92);
  DsaIndexerOptions o;
  o.top_k = 40;
  Tensor idx = IndexerTopK(ix.q, ix.k, ix.w, o);
  Tensor dO = torch::randn({B, H, S, Dv}, torch::kFloat64);
  Tensor dO_rows = torch::zeros_like(dO);
  dO_rows.narrow(2, t0, n).copy_(dO.narrow(2, t0, n));
  const std::vector<Tensor> whole = RunAttention(true, x, idx, dO_rows);
  const Qkv tail{x.q.narrow(2, t0, n), x.k, x.v};
  const std::vector<Tensor> got = RunAttention(true, tail, idx.narrow(1, t0, n), dO.narrow(2, t0, n), 13);
  ASSERT_EQ(got[0].sizes(), torch::IntArrayRef({B, H, n, Dv}));
  ASSERT_EQ(got[2].sizes(), x.k.sizes());
  ASSERT_EQ(got[3].sizes(), x.v.sizes());
  EXPECT_LT(MaxErr(got[0], whole[0].narrow(2, t0, n)), 1e-12) << "o";
  EXPECT_LT(MaxErr(got[1], whole[1].narrow(2, t0, n)), 1e-12) << "dq";
  EXPECT_LT(MaxErr(got[2], whole[2]), 1e-12) << "dk";
  EXPECT_LT(MaxErr(got[3], whole[3]), 1e-12) << "dv";
  EXPECT_GT(got[2].abs().max().item<double>(), 0.0);
}

TEST(DsaSparseAttention, Fp32WithinTwiceTheMaskedDenseError) {
  const int64_t B = 1, H = 4, Hkv = 1, S = 257, D = 32, Dv = 32;  // MQA as in V3.2
  Qkv x = MakeQkv(B, H, Hkv, S, D, Dv, 23);
  Indexer ix = MakeIndexer(B, 2, S, 8, torch::kFloat32, 24);
  DsaIndexerOptions o;
  o.top_k = 64;
  Tensor idx = IndexerTopK(ix.q, ix.k, ix.w, o);
  Tensor dO = torch::randn({B, H, S, Dv}, torch::kFloat64);
  std::vector<Tensor> truth = RunAttention(false, x, idx, dO);
  Qkv f{x.q.to(torch::kFloat32), x.k.to(torch::kFloat32), x.v.to(torch::kFloat32)};
  std::vector<Tensor> dense = RunAttention(false, f, idx, dO.to(torch::kFloat32)), got = RunAttention(true, f, idx, dO.to(torch::kFloat32));
  for (int i = 0; i < 4; ++i) {
    const double scale = truth[i].abs().max().item<double>();
    EXPECT_LE(MaxErr(got[i], truth[i]), 2 * MaxErr(dense[i], truth[i]) + 8 * FLT_EPSILON * scale) << kNames[i];
    EXPECT_EQ(got[i].scalar_type(), torch::kFloat32);
  }
}

// k >= the number of causal keys: sparse attention is dense causal attention, checked against the
// math backend of kernels/attention.h (outputs and gradients), for token keys (top_k = S) and for
// GLM's pooled keys with 4 kp >= S (the pools plus the tail cover every causal key).
TEST(DsaSparseAttention, FullSelectionEqualsDenseCausalAttention) {
  const int64_t B = 1, H = 4, Hkv = 2, S = 61, D = 16;
  Qkv x = MakeQkv(B, H, Hkv, S, D, D, 25);
  auto math = MakeAttentionBackend("math");
  ASSERT_TRUE(math.ok());
  Tensor dO = torch::randn({B, H, S, D}, torch::kFloat64);
  Tensor q = x.q.clone().requires_grad_(), k = x.k.clone().requires_grad_(), v = x.v.clone().requires_grad_();
  Tensor o_ref = (*math)->Causal(q, k, v, 1.0 / std::sqrt(double(D)));
  (o_ref * dO).sum().backward();
  std::vector<Tensor> ref{o_ref.detach(), q.grad(), k.grad(), v.grad()};

  Indexer ix = MakeIndexer(B, 2, S, 8, torch::kFloat64, 26);
  DsaIndexerOptions tok;
  tok.top_k = 64;  // >= S
  Tensor idx_tok = IndexerTopK(ix.q, ix.k, ix.w, tok);
  DsaIndexerOptions pool;
  pool.top_k = 16;  // 16 pools = 64 tokens >= S
  pool.pool = 4;
  Tensor pooled = KeyPool4(ix.k, torch::randn_like(ix.k), torch::randn({4, 8}, torch::kFloat64));
  Tensor idx_pool = ExpandPoolSelection(IndexerTopK(ix.q, pooled, ix.w, pool));
  for (const Tensor& idx : {idx_tok, idx_pool}) {
    std::vector<Tensor> got = RunAttention(true, x, idx, dO);
    // The math backend computes in fp32 whatever the input: the bar is its precision.
    for (int i = 0; i < 4; ++i) EXPECT_LT(MaxErr(got[i], ref[i]), 2e-5) << kNames[i] << " width " << idx.size(2);
  }
}

// The CUDA kernels (kernels/cuda/sparse_attention.h) against the fp64 truth on the same rounded
// inputs: output and every gradient within twice the error of the libtorch path on the same
// device and dtype (plus eight fp32 ulps at the tensor's scale), fp32 and bf16; every head
// grouping the kernels take (G = 3, 8 -> 4 + 4, 2, 1), D and Dv of 64 and 128, q read through
// the strides of a (B, S, H, D) tensor, a query with no valid key (zeros), the key-side backward
// in one segment and in many, over token selections, pool selections (a run of 4 keys per pool)
// and pool selections reversed (no runs); the backward is deterministic (bitwise equal when run twice) and
// the launch counter shows the kernels ran.
TEST(DsaSparseAttention, KernelsWithinTwiceTheLibtorchError_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  struct Case {
    int64_t B, H, Hkv, S, D, Dv, top_k, pairs;
    bool strided;
  };
  for (const Case& c : {Case{2, 6, 2, 300, 128, 128, 100, int64_t{1} << 27, true},
                        Case{1, 8, 1, 257, 64, 64, 64, 1000, false}, Case{1, 4, 2, 200, 128, 64, 300, 5000, false},
                        Case{1, 5, 5, 150, 64, 128, 40, 3000, true}}) {
    // fp32 on CUDA cores; bf16 on the tensor cores and on CUDA cores.
    for (const auto& [dt, tc] : {std::pair{torch::kFloat32, false}, std::pair{torch::kBFloat16, true},
                                 std::pair{torch::kBFloat16, false}}) {
      SetSparseTensorCores(tc);
      const std::string base = "B" + std::to_string(c.B) + " H" + std::to_string(c.H) + "/" + std::to_string(c.Hkv) +
                               " D" + std::to_string(c.D) + "/" + std::to_string(c.Dv) +
                               (dt == torch::kBFloat16 ? " bf16" : " fp32") + (tc ? " tensor cores" : "");
      Qkv x = MakeQkv(c.B, c.H, c.Hkv, c.S, c.D, c.Dv, 31);
      auto round = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
      Qkv r{round(x.q), round(x.k), round(x.v)};
      Indexer ix = MakeIndexer(c.B, 2, c.S, 8, torch::kFloat64, 32);
      DsaIndexerOptions o;
      o.top_k = c.top_k;
      DsaIndexerOptions pools = o;
      pools.pool = 4;
      pools.top_k = std::max<int64_t>(1, c.top_k / 4);
      Tensor pooled = KeyPool4(ix.k, torch::randn_like(ix.k), torch::randn({4, 8}, torch::kFloat64));
      Tensor by_pool = ExpandPoolSelection(IndexerTopK(ix.q, pooled, ix.w, pools));
      Tensor dO = round(torch::randn({c.B, c.H, c.S, c.Dv}, torch::kFloat64));
      // Token selections (few runs within a block of 4 keys), pool selections (a run per pool,
      // and the tail), and the pool selections reversed (keys falling: every entry its own run).
      for (const auto& [what, sel] : {std::pair<std::string, Tensor>{"tokens", IndexerTopK(ix.q, ix.k, ix.w, o)},
                                      {"pools", by_pool}, {"pools reversed", by_pool.flip(2)}}) {
        const std::string name = base + " " + what;
        Tensor idx = sel.contiguous();
        idx.select(1, 7).fill_(-1);  // query 7 selects nothing
        std::vector<Tensor> truth = RunAttention(true, r, idx, dO);
        auto dev = [&](const Tensor& t) { return t.to(torch::kCUDA, dt); };
        Tensor qd = c.strided ? dev(r.q.transpose(1, 2).contiguous()).transpose(1, 2) : dev(r.q);
        Qkv g{qd, dev(r.k), dev(r.v)};
        Tensor idxd = idx.cuda(), dOd = dev(dO);
        SetFusedKernels(false);
        std::vector<Tensor> ref = RunAttention(true, g, idxd, dOd);
        SetFusedKernels(true);
        const int64_t launches = FusedKernelLaunches(), tc_launches = SparseTensorCoreLaunches();
        std::vector<Tensor> got = RunAttention(true, g, idxd, dOd, 128, c.pairs);
        EXPECT_GE(FusedKernelLaunches() - launches, 3) << name << ": the kernels did not run";
        EXPECT_EQ(SparseTensorCoreLaunches() - tc_launches >= 3, tc) << name << ": the tensor-core path";
        std::vector<Tensor> again = RunAttention(true, g, idxd, dOd, 128, c.pairs);
        for (int i = 0; i < 4; ++i) {
          const double scale = truth[i].abs().max().item<double>();
          EXPECT_LE(MaxErr(got[i].cpu(), truth[i]), 2 * MaxErr(ref[i].cpu(), truth[i]) + 8 * FLT_EPSILON * scale)
              << name << " " << kNames[i];
          EXPECT_EQ(got[i].scalar_type(), dt) << name << " " << kNames[i];
          EXPECT_TRUE(torch::equal(got[i], again[i])) << name << " " << kNames[i] << ": not deterministic";
        }
        EXPECT_EQ(got[0].select(2, 7).abs().max().item<double>(), 0.0) << name << ": a query without keys";
        EXPECT_EQ(got[1].select(2, 7).abs().max().item<double>(), 0.0) << name << ": its dq";
      }
    }
  }
  SetSparseTensorCores(true);
}

// The kernels run tile by tile as a caller of SparseAttentionForward / SparseAttentionBackward
// does (bf16, GQA 6/2, D 128 and Dv 64, pool selections, a query without keys, a backward_pairs
// small enough for several key-side segments a tile): each tile's out, lse and dq equal the whole
// sequence's exactly (every query's walk is its own), and dk, dv summed over the tiles' launches
// equal the whole's within fp32 summation-order noise.
TEST(DsaSparseAttention, KernelTilesEqualTheWholeSequence_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  const int64_t B = 2, H = 6, Hkv = 2, S = 700, D = 128, Dv = 64;
  Qkv x = MakeQkv(B, H, Hkv, S, D, Dv, 101);
  Tensor idx = PooledIndices(B, S, 16, 102, /*empty_query=*/40);
  auto dev = [](const Tensor& t) { return t.to(torch::kCUDA, torch::kBFloat16); };
  const Tensor q = dev(x.q), k = dev(x.k), v = dev(x.v), idxd = idx.cuda();
  const Tensor dO = dev(torch::randn({B, H, S, Dv}, torch::kFloat64));
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(torch::kCUDA);
  const int64_t pairs = 5000;
  SetFusedKernels(true);
  const int64_t launches = FusedKernelLaunches();
  const SparseAttentionResult whole = SparseAttentionForward(q, k, v, idxd);
  Tensor dk = torch::zeros({B, Hkv, S, D}, f32), dv = torch::zeros({B, Hkv, S, Dv}, f32);
  const Tensor dq = SparseAttentionBackward(dO, q, k, v, idxd, whole.lse, 0.0, dk, dv, 128, pairs);
  EXPECT_GE(FusedKernelLaunches() - launches, 3) << "the kernels did not run";
  EXPECT_EQ(whole.lse.scalar_type(), torch::kFloat32);
  Tensor dk_t = torch::zeros_like(dk), dv_t = torch::zeros_like(dv);
  for (const auto& [t0, t1] : Tiles(S, {0, 37, 300})) {
    const int64_t n = t1 - t0;
    const Tensor qt = q.narrow(2, t0, n), it = idxd.narrow(1, t0, n);
    const SparseAttentionResult r = SparseAttentionForward(qt, k, v, it);
    const std::string name = "tile at " + std::to_string(t0);
    EXPECT_TRUE(torch::equal(r.out, whole.out.narrow(2, t0, n))) << name << " out";
    EXPECT_TRUE(torch::equal(r.lse, whole.lse.narrow(2, t0, n))) << name << " lse";
    const Tensor dqt = SparseAttentionBackward(dO.narrow(2, t0, n), qt, k, v, it, r.lse, 0.0, dk_t, dv_t, 128, pairs);
    EXPECT_TRUE(torch::equal(dqt, dq.narrow(2, t0, n))) << name << " dq";
  }
  EXPECT_LT(((dk_t - dk).norm() / dk.norm()).item<double>(), 1e-4) << "dk";
  EXPECT_LT(((dv_t - dv).norm() / dv.norm()).item<double>(), 1e-4) << "dv";
  EXPECT_GT(dk.abs().max().item<double>(), 0.0);
}

// The CUDA indexer (kernels/cuda/dsa_indexer.h) against the libtorch selection on the same GPU
// tensors. Small-integer q, k and power-of-two w make every score exact in both (the fp32 sums
// of products of small integers are exact in any order, and both divide by the same sqrt(D)), and
// full of ties: the selections must be equal, the tie rule included, at awkward lengths, D 64 and
// 128, HI 32 and 5, pools of 4 and 1, top_k below and above the visible items, and a workspace so
// small that the sequence runs in many chunks. Normal inputs: the kernel's picks score (in fp64)
// as the libtorch picks do, position by position, within fp32 rounding of the row's scale.
TEST(DsaIndexer, KernelSelectsAsTheLibtorchPath_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  // `two_keys`: every key item is one of two, so a query's scores take two values and the
  // top_k-th is shared by about half the row. The select kernel sorts the keys that share the
  // top_k-th key's 16 high bits itself when at most kSelectCandidates do
  // (kernels/cuda/dsa_indexer.cu's kCandidates), and otherwise takes two more radix passes over
  // the row; that case's rows run both ways (checked below).
  constexpr int64_t kSelectCandidates = 2048;
  struct Case {
    int64_t B, HI, S, D, pool, top_k, workspace;
    bool two_keys = false;
  };
  for (const Case& c : {Case{2, 32, 1237, 128, 4, 64, int64_t{1} << 28}, Case{1, 5, 3001, 64, 4, 97, 64 * 1024},
                        Case{1, 32, 2050, 128, 1, 512, 200 * 1024}, Case{2, 7, 700, 128, 1, 1000, int64_t{1} << 28},
                        Case{1, 32, 4099, 128, 4, 512, 1 << 20}, Case{1, 4, 6000, 64, 1, 64, int64_t{1} << 28, true}}) {
    const std::string name = "B" + std::to_string(c.B) + " HI" + std::to_string(c.HI) + " S" + std::to_string(c.S) +
                             " D" + std::to_string(c.D) + " pool" + std::to_string(c.pool) + " top_k" +
                             std::to_string(c.top_k) + " ws" + std::to_string(c.workspace) +
                             (c.two_keys ? " two keys" : "");
    const int64_t P = c.pool == 1 ? c.S : c.S / c.pool;
    DsaIndexerOptions o;
    o.top_k = c.top_k;
    o.pool = c.pool;
    o.workspace_bytes = c.workspace;
    auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
    for (bool exact : {true, false}) {
      torch::manual_seed(40 + c.S);
      Tensor q, k, w;
      if (exact) {
        q = torch::randint(-2, 3, {c.B, c.HI, c.S, c.D}).to(bf);
        k = c.two_keys ? torch::randint(-2, 3, {c.B, 2, c.D}).index_select(1, torch::randint(0, 2, {P})).to(bf)
                       : torch::randint(-2, 3, {c.B, P, c.D}).to(bf);
        w = torch::pow(2.0, torch::randint(-3, 1, {c.B, c.S, c.HI})) * (torch::randint(0, 2, {c.B, c.S, c.HI}) * 2 - 1);
        w = w.to(bf);
      } else {
        q = torch::randn({c.B, c.HI, c.S, c.D}).to(bf);
        k = torch::randn({c.B, P, c.D}).to(bf);
        w = torch::randn({c.B, c.S, c.HI}).to(bf);
      }
      SetFusedKernels(false);
      Tensor ref = IndexerTopK(q, k, w, o).cpu();
      SetFusedKernels(true);
      const int64_t launches = FusedKernelLaunches();
      Tensor got = IndexerTopK(q, k, w, o);
      EXPECT_GE(FusedKernelLaunches() - launches, 2) << name << ": the kernels did not run";
      ASSERT_EQ(got.sizes(), ref.sizes()) << name;
      got = got.cpu();
      Tensor scores = IndexerScores(q.to(torch::kFloat64), k.to(torch::kFloat64), w.to(torch::kFloat64)).cpu();
      int64_t rows = 0;
      if (exact) {
        EXPECT_TRUE(torch::equal(got, ref)) << name << ": " << got.ne(ref).sum().item<int64_t>() << " entries differ";
        ExpectFollowsRule(got, scores, c.top_k, c.pool, &rows);
        EXPECT_EQ(rows, c.B * c.S) << name;
        if (c.two_keys) {
          // Rows whose top_k-th score is shared by more keys than the kernel sorts itself, and
          // rows past top_k visible items where it is not (exact scores: equal values, equal keys).
          int64_t many = 0, few = 0;
          for (int64_t t = c.top_k; t < c.S; ++t) {
            const Tensor row = scores[0][t].narrow(0, 0, t + 1);
            const double kth = std::get<0>(row.topk(c.top_k)).min().item<double>();
            (row.eq(kth).sum().item<int64_t>() > kSelectCandidates ? many : few) += 1;
          }
          EXPECT_GT(many, 0) << name << ": no row took the radix passes to the end";
          EXPECT_GT(few, 0) << name << ": no row sorted its candidates itself";
        }
      } else {
        EXPECT_TRUE(torch::equal(got.lt(0), ref.lt(0))) << name << ": padding differs";
        auto at = [&](const Tensor& sel) {
          return scores.gather(2, sel.clamp_min(0).to(torch::kLong)).masked_fill(sel.lt(0), 0.0);
        };
        const double scale = scores.abs().max().item<double>();
        EXPECT_LE((at(got) - at(ref)).abs().max().item<double>(), 1e-5 * scale) << name;
        EXPECT_GT(got.eq(ref).to(torch::kFloat64).mean().item<double>(), 0.99) << name << ": too few equal picks";
      }
    }
  }
}

// The CUDA indexer by query tiles (bf16 normal inputs) selects exactly the whole sequence's rows
// of the same kernels: a row's scores are the same mma products whatever chunk and 64-query block
// it falls in, and its selection is its own. Pools of 4 (tiles starting inside a pool) and 1, a
// workspace small enough that the whole sequence and the long tile run in several chunks.
TEST(DsaIndexer, KernelQueryTilesSelectTheWholeSequencesRows_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  const int64_t B = 2, HI = 32, S = 1237, D = 128;
  auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  torch::manual_seed(44);
  const Tensor q = torch::randn({B, HI, S, D}).to(bf), w = torch::randn({B, S, HI}).to(bf);
  for (int64_t pool : {4, 1}) {
    const Tensor k = torch::randn({B, S / pool, D}).to(bf);
    DsaIndexerOptions o;
    o.top_k = pool == 4 ? 64 : 256;
    o.pool = pool;
    o.workspace_bytes = 256 * 1024;
    SetFusedKernels(true);
    const int64_t launches = FusedKernelLaunches();
    const Tensor whole = IndexerTopK(q, k, w, o);
    EXPECT_GE(FusedKernelLaunches() - launches, 2) << "pool " << pool << ": the kernels did not run";
    for (const auto& [t0, t1] : Tiles(S, {0, 37, 100, 700})) {
      DsaIndexerOptions tile = o;
      tile.query_offset = t0;
      const Tensor got = IndexerTopK(q.narrow(2, t0, t1 - t0), k, w.narrow(1, t0, t1 - t0), tile);
      ASSERT_EQ(got.sizes(), torch::IntArrayRef({B, t1 - t0, o.top_k}));
      EXPECT_TRUE(torch::equal(got, whole.narrow(1, t0, t1 - t0)))
          << "pool " << pool << " tile at " << t0 << ": " << got.ne(whole.narrow(1, t0, t1 - t0)).sum().item<int64_t>()
          << " entries differ";
    }
  }
}

// The KL target's probabilities: softmax of the dense scores masked to the selected keys, averaged
// over heads and read at the selected entries (fp64, GQA 6/2, a row without keys); a chunk of the
// queries against all keys gives the same rows.
TEST(DsaSparseAttention, ProbsEqualTheMaskedDenseSoftmaxFp64) {
  const int64_t B = 2, H = 6, Hkv = 2, S = 150, D = 16;
  Qkv x = MakeQkv(B, H, Hkv, S, D, D, 51);
  Indexer ix = MakeIndexer(B, 2, S, 8, torch::kFloat64, 52);
  DsaIndexerOptions o;
  o.top_k = 40;
  Tensor idx = IndexerTopK(ix.q, ix.k, ix.w, o);
  idx.select(1, 9).fill_(-1);  // query 9 selects nothing
  Tensor got = SparseAttentionProbs(x.q, x.k, idx, 0.0, 17);
  ASSERT_EQ(got.sizes(), torch::IntArrayRef({B, S, o.top_k}));
  // Reference: (B, H, S, S) scores, -inf off the selection, softmax, head mean, then gathered.
  Tensor il = idx.to(torch::kLong);
  Tensor sel = torch::zeros({B, S, S + 1}, torch::kBool).scatter_(2, torch::where(il >= 0, il, S), true)
                   .narrow(2, 0, S);  // (B, S, S) selected keys
  Tensor kq = x.k.repeat_interleave(H / Hkv, 1);
  Tensor sc = torch::matmul(x.q, kq.transpose(2, 3)) / std::sqrt(double(D));
  sc = sc.masked_fill(sel.unsqueeze(1).logical_not(), -std::numeric_limits<double>::infinity());
  Tensor mean = torch::softmax(sc, -1).nan_to_num(0.0).mean(1);  // (B, S, S)
  Tensor want = mean.gather(2, il.clamp_min(0)).masked_fill(il < 0, 0.0);
  EXPECT_LT(MaxErr(got, want), 1e-12);
  EXPECT_EQ(got.select(1, 9).abs().max().item<double>(), 0.0);
  // Each row with keys sums to 1.
  EXPECT_LT((got.sum(-1).narrow(1, 10, S - 10) - 1).abs().max().item<double>(), 1e-12);
  Tensor part = SparseAttentionProbs(x.q.narrow(2, 50, 60), x.k, idx.narrow(1, 50, 60));
  EXPECT_LT(MaxErr(part, got.narrow(1, 50, 60)), 1e-12);
  // With the forward's log-sum-exp given: the same; and it is what is used (one more than the
  // true one scales every probability by 1/e).
  const Tensor lse = SparseAttentionForward(x.q, x.k, x.v, idx).lse;
  EXPECT_LT(MaxErr(SparseAttentionProbs(x.q, x.k, idx, 0.0, 17, lse), got), 1e-12);
  EXPECT_LT(MaxErr(SparseAttentionProbs(x.q, x.k, idx, 0.0, 17, lse + 1.0), got * std::exp(-1.0)), 1e-12);
  EXPECT_LT(MaxErr(SparseAttentionProbs(x.q.narrow(2, 50, 60), x.k, idx.narrow(1, 50, 60), 0.0, 64,
                                        lse.narrow(2, 50, 60)),
                   got.narrow(1, 50, 60)),
            1e-12);
  EXPECT_THROW(SparseAttentionProbs(x.q, x.k, idx, 0.0, 17, lse.narrow(2, 0, 10)), c10::Error);
}

// The indexer's KL loss over its selected pools, its value and gradients against plain autograd
// of the formula over the whole sequence at once (fp64), with pools (-1 for the first rows) and a
// row of no pool, in one block and in awkward blocks.
TEST(DsaIndexer, KlLossEqualsAutogradOfTheFormulaFp64) {
  const int64_t B = 2, HI = 3, S = 121, D = 16;
  Indexer ix = MakeIndexer(B, HI, S, D, torch::kFloat64, 61);
  torch::manual_seed(62);
  Tensor keys = torch::randn({B, S / 4, D}, torch::kFloat64);
  DsaIndexerOptions o;
  o.top_k = 8;
  o.pool = 4;
  Tensor pool_idx = IndexerTopK(ix.q, keys, ix.w, o);  // (B, S, 8)
  Tensor valid = pool_idx >= 0;
  Tensor target = torch::rand({B, S, o.top_k}, torch::kFloat64).masked_fill(valid.logical_not(), 0.0);
  target = target / target.sum(-1, true).clamp_min(1e-30);
  ASSERT_EQ(valid.select(2, 0).logical_not().sum().item<int64_t>(), 3 * B);  // rows 0..2 hold no pool
  auto leaf = [](const Tensor& t) { return t.detach().clone().requires_grad_(true); };
  Tensor q0 = leaf(ix.q), k0 = leaf(keys), w0 = leaf(ix.w);
  // Reference: every row at once, by autograd.
  Tensor pl = pool_idx.to(torch::kLong).clamp_min(0);
  Tensor ksel = k0.gather(1, pl.view({B, S * o.top_k, 1}).expand({B, S * o.top_k, D})).view({B, S, o.top_k, D});
  Tensor logits = (torch::einsum("bhqd,bqpd->bhqp", {q0, ksel}).relu() * w0.permute({0, 2, 1}).unsqueeze(-1)).sum(1) /
                  std::sqrt(double(D));
  Tensor row_has = valid.any(-1, true);
  Tensor logp = torch::log_softmax(
      torch::where(row_has, logits.masked_fill(valid.logical_not(), -std::numeric_limits<double>::infinity()),
                   torch::zeros({}, logits.options())),
      -1);
  Tensor want = torch::where(target > 0, target * (target.clamp_min(1e-30).log() - logp),
                             torch::zeros({}, logp.options()))
                    .sum();
  want.backward();
  // A pool past k_idx's rows is refused naming the rule, not read.
  {
    Tensor bad = pool_idx.clone();
    bad.select(1, S - 1).select(1, 0).fill_(static_cast<int32_t>(keys.size(1)));
    try {
      IndexerKlLoss(ix.q, keys, ix.w, bad, target);
      ADD_FAILURE() << "a pool index past P was accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find("IndexerKlLoss: pool_idx must lie in [-1, P) (P = 30"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
  for (int64_t block : {int64_t{256}, int64_t{7}}) {
    Tensor q1 = leaf(ix.q), k1 = leaf(keys), w1 = leaf(ix.w);
    Tensor got = IndexerKlLoss(q1, k1, w1, pool_idx, target, block);
    EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-12) << "block " << block;
    (got * 2.5).backward();  // an upstream gradient other than 1
    EXPECT_LT(MaxErr(q1.grad(), q0.grad() * 2.5), 1e-10) << "dq, block " << block;
    EXPECT_LT(MaxErr(k1.grad(), k0.grad() * 2.5), 1e-10) << "dk, block " << block;
    EXPECT_LT(MaxErr(w1.grad(), w0.grad() * 2.5), 1e-10) << "dw, block " << block;
    EXPECT_GT(k1.grad().abs().max().item<double>(), 0.0);
  }
}

// The probabilities' kernel (bf16 and fp32 inputs, GQA 24/8 and MHA, D 64 and 128, a query chunk
// against all keys, a row without keys) within twice the libtorch path's error against fp64, and
// deterministic.
TEST(DsaSparseAttention, ProbsKernelWithinTwiceTheLibtorchError_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  struct Case {
    int64_t B, H, Hkv, S, D, top_k;
  };
  for (const Case& c : {Case{1, 24, 8, 700, 128, 300}, Case{2, 5, 5, 257, 64, 64}}) {
    for (const auto& [dt, tc] : {std::pair{torch::kBFloat16, true}, std::pair{torch::kBFloat16, false},
                                 std::pair{torch::kFloat32, false}}) {
      SetSparseTensorCores(tc);
      const std::string name = "H" + std::to_string(c.H) + "/" + std::to_string(c.Hkv) + " D" + std::to_string(c.D) +
                               (dt == torch::kBFloat16 ? " bf16" : " fp32") + (tc ? " tensor cores" : "");
      Qkv x = MakeQkv(c.B, c.H, c.Hkv, c.S, c.D, c.D, 71);
      Indexer ix = MakeIndexer(c.B, 2, c.S, 8, torch::kFloat64, 72);
      DsaIndexerOptions o;
      o.top_k = c.top_k;
      Tensor idx = IndexerTopK(ix.q, ix.k, ix.w, o);
      idx.select(1, 30).fill_(-1);
      const int64_t t0 = 20, n = c.S - 40;
      auto round = [&](const Tensor& t) { return t.to(dt).to(torch::kFloat64); };
      Tensor qr = round(x.q).narrow(2, t0, n), kr = round(x.k);
      Tensor truth = SparseAttentionProbs(qr, kr, idx.narrow(1, t0, n));
      auto dev = [&](const Tensor& t) { return t.to(torch::kCUDA, dt); };
      Tensor qd = dev(qr), kd = dev(kr), id = idx.narrow(1, t0, n).cuda();
      SetFusedKernels(false);
      Tensor ref = SparseAttentionProbs(qd, kd, id).cpu();
      SetFusedKernels(true);
      const int64_t launches = FusedKernelLaunches();
      Tensor got = SparseAttentionProbs(qd, kd, id);
      EXPECT_GE(FusedKernelLaunches() - launches, 1) << name << ": the kernel did not run";
      Tensor again = SparseAttentionProbs(qd, kd, id);
      EXPECT_TRUE(torch::equal(got, again)) << name << ": not deterministic";
      got = got.cpu();
      EXPECT_LE(MaxErr(got, truth), 2 * MaxErr(ref, truth) + 8 * FLT_EPSILON) << name;
      EXPECT_EQ(got.select(1, 30 - t0).abs().max().item<double>(), 0.0) << name << ": a row without keys";
      // One walk, given the forward kernel's log-sum-exp of the same rows: the same bar; one
      // more than the true log-sum-exp scales every probability by 1/e.
      const Tensor lse = SparseAttentionForward(qd, kd, kd, id).lse;
      const int64_t before = FusedKernelLaunches(), tc_before = SparseTensorCoreLaunches();
      Tensor given = SparseAttentionProbs(qd, kd, id, 0.0, 64, lse);
      EXPECT_GE(FusedKernelLaunches() - before, 1) << name << ": the kernel did not run with lse";
      EXPECT_EQ(SparseTensorCoreLaunches() - tc_before >= 1, tc) << name << ": the tensor-core path";
      EXPECT_LE(MaxErr(given.cpu(), truth), 2 * MaxErr(ref, truth) + 8 * FLT_EPSILON) << name << " with lse";
      EXPECT_EQ(given.cpu().select(1, 30 - t0).abs().max().item<double>(), 0.0) << name << ": no keys, with lse";
      EXPECT_LE(MaxErr(SparseAttentionProbs(qd, kd, id, 0.0, 64, lse + 1.0).cpu(), given.cpu() * std::exp(-1.0)),
                1e-6)
          << name << ": the given lse is not what the kernel used";
    }
  }
  SetSparseTensorCores(true);
}

// The indexer KL's CUDA kernels (kernels/cuda/indexer_kl.h) against the libtorch path on the same
// bf16 GPU inputs, both measured against fp64 of the same rounded values: the loss and dq, dk, dw
// (an upstream gradient of 2.5) within twice the libtorch path's error plus fp32 noise. Rows
// without a valid pool (the first three), a -1 inside a row, kp not a multiple of the kernels'
// chunk of 16, HI 32 / DI 128 (hybrid-3b's indexer) and HI 8 / DI 64 with two batch rows.
// The dense warm-up's KL (spec 2.3) against the formula written out here over the whole (S, S)
// attention and (S, S / 4) scores at once, by autograd in fp64: loss and the gradients of the
// indexer's q, k and w equal for every block size (one row, a size that divides nothing, more
// than the sequence), S not a multiple of 4, GQA. The reference graph form agrees too.
TEST(DsaIndexer, DenseWarmupKlEqualsTheWholeFormulaFp64) {
  const int64_t B = 2, HI = 3, DI = 16, H = 4, Hkv = 2, D = 8, S = 43, P = S / 4;
  torch::manual_seed(71);
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const Tensor qi = torch::randn({B, HI, S, DI}, f64), keys = torch::randn({B, P, DI}, f64);
  const Tensor w = torch::randn({B, S, HI}, f64), q = torch::randn({B, H, S, D}, f64), k = torch::randn({B, Hkv, S, D}, f64);
  auto leaf = [](const Tensor& t) { return t.detach().clone().requires_grad_(true); };
  Tensor q0 = leaf(qi), k0 = leaf(keys), w0 = leaf(w);
  const double inf = std::numeric_limits<double>::infinity();
  Tensor target, valid;
  {
    const Tensor kq = k.repeat_interleave(H / Hkv, 1);                                // (B, H, S, D)
    Tensor sc = torch::matmul(q, kq.transpose(2, 3)) / std::sqrt(double(D));           // (B, H, S, S)
    sc = sc.masked_fill(torch::ones({S, S}, torch::kBool).triu(1), -inf);
    const Tensor p = torch::softmax(sc, -1).mean(1);                                    // (B, S, S)
    const Tensor t = torch::arange(S).view({S, 1}), pools = torch::arange(P).view({1, P});
    valid = (pools * 4 + 3 <= t).unsqueeze(0).expand({B, S, P});
    target = p.narrow(2, 0, 4 * P).view({B, S, P, 4}).sum(-1).masked_fill(valid.logical_not(), 0.0);
    target = target / target.sum(-1, true).clamp_min(1e-30);
  }
  const Tensor logits = (torch::einsum("bhqd,bpd->bhqp", {q0, k0}).relu() * w0.permute({0, 2, 1}).unsqueeze(-1)).sum(1) /
                        std::sqrt(double(DI));
  const Tensor row_has = valid.any(-1, true);
  const Tensor logp = torch::log_softmax(
      torch::where(row_has, logits.masked_fill(valid.logical_not(), -inf), torch::zeros({}, logits.options())), -1);
  const Tensor want = torch::where(target > 0, target * (target.clamp_min(1e-30).log() - logp),
                                   torch::zeros({}, logp.options()))
                          .sum();
  want.backward();
  for (int64_t block : {int64_t{1}, int64_t{7}, int64_t{64}}) {
    for (bool reference : {false, true}) {
      Tensor q1 = leaf(qi), k1 = leaf(keys), w1 = leaf(w);
      const Tensor got = reference ? DenseWarmupKlReference(q1, k1, w1, q, k, block) : DenseWarmupKl(q1, k1, w1, q, k, block);
      // The Function forms its gradients in the forward for a unit upstream gradient: a loss
      // weight other than 1 must reach all three.
      const double weight = reference ? 1.0 : 2.5;
      (got * weight).backward();
      const std::string name = std::string(reference ? "reference" : "function") + " block " + std::to_string(block);
      EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-10 * std::abs(want.item<double>())) << name;
      EXPECT_LT(RelErr(q1.grad(), q0.grad() * weight), 1e-10) << name << " dq";
      EXPECT_LT(RelErr(k1.grad(), k0.grad() * weight), 1e-10) << name << " dk";
      EXPECT_LT(RelErr(w1.grad(), w0.grad() * weight), 1e-10) << name << " dw";
    }
    // A checkpoint's first forward runs without gradients: the value alone, the same.
    torch::NoGradGuard no_grad;
    const Tensor value = DenseWarmupKl(leaf(qi), leaf(keys), leaf(w), q, k, block);
    EXPECT_FALSE(value.requires_grad()) << block;
    EXPECT_NEAR(value.item<double>(), want.item<double>(), 1e-10 * std::abs(want.item<double>())) << block;
  }
  EXPECT_GE(DenseWarmupKlBlock(int64_t{1} << 20, 24, 32), 1);
  EXPECT_EQ(DenseWarmupKlBlock(64, 24, 32), 1024);
  EXPECT_EQ(DenseWarmupKlBlock(int64_t{1} << 17, 24, 32), 32);  // hybrid-3b at 128K: 512 MiB of fp32 rows
  EXPECT_LE(DenseWarmupKlBlock(int64_t{1} << 20, 24, 32) * (int64_t{1} << 20) * 4 * 32, int64_t{512} << 20);
  EXPECT_EQ(DenseWarmupKlBlock(int64_t{1} << 17, 24, 32, /*target_by_kernels=*/true), 512);  // the indexer's rows alone, 2 GiB
  EXPECT_EQ(DenseWarmupKlBlockFor(qi, q, k), DenseWarmupKlBlock(S, H, HI));  // fp64 on the CPU: libtorch's target
  try {
    DenseWarmupKl(qi, keys.narrow(1, 0, P - 1), w, q, k, 8);
    ADD_FAILURE() << "k_idx without every pool was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("DenseWarmupKl: k_idx must hold the S / 4 pools"),
              std::string::npos)
        << e.what_without_backtrace();
  }
}

// The dense warm-up's KL on the GPU with bf16 inputs: the target's scores and the indexer's dot
// products are the tensor cores' bf16 products with fp32 outputs (exact products, fp32 sums), so
// value and gradients equal the fp64 computation on the same bf16 values up to fp32 sums, the
// indexer gradient's one bf16 rounding before its two matmuls and the gradients' own: value
// within 1e-4, gradients within 1e-2 (bf16's 2^-8 with room). GQA 24/8 as hybrid-3b, a block
// size that divides nothing.
TEST(DsaIndexer, DenseWarmupKlBf16OnTheGpuEqualsFp64_cuda) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  const int64_t B = 1, HI = 4, DI = 64, H = 24, Hkv = 8, D = 128, S = 301, P = S / 4;
  torch::manual_seed(83);
  const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
  const Tensor qi = torch::randn({B, HI, S, DI}, bf), keys = torch::randn({B, P, DI}, bf);
  const Tensor w = torch::randn({B, S, HI}, bf), q = torch::randn({B, H, S, D}, bf) * 2, k = torch::randn({B, Hkv, S, D}, bf);
  auto leaf = [](const Tensor& t, torch::Dtype dt, torch::Device dev) {
    return t.detach().to(dev, dt).clone().requires_grad_(true);
  };
  const torch::Device cpu(torch::kCPU), gpu(torch::kCUDA);
  Tensor q64 = leaf(qi, torch::kFloat64, cpu), k64 = leaf(keys, torch::kFloat64, cpu), w64 = leaf(w, torch::kFloat64, cpu);
  const Tensor want = DenseWarmupKl(q64, k64, w64, q.to(cpu, torch::kFloat64), k.to(cpu, torch::kFloat64), 37);
  want.backward();
  Tensor q1 = leaf(qi, torch::kBFloat16, gpu), k1 = leaf(keys, torch::kBFloat16, gpu), w1 = leaf(w, torch::kBFloat16, gpu);
  const Tensor got = DenseWarmupKl(q1, k1, w1, q, k, 37);
  got.backward();
  EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-4 * std::abs(want.item<double>()));
  EXPECT_LT(RelErr(q1.grad().to(cpu, torch::kFloat64), q64.grad()), 1e-2);
  EXPECT_LT(RelErr(k1.grad().to(cpu, torch::kFloat64), k64.grad()), 1e-2);
  EXPECT_LT(RelErr(w1.grad().to(cpu, torch::kFloat64), w64.grad()), 1e-2);
}

// The dense warm-up's target by the CUDA kernels (kernels/cuda/warmup_target.h: the scores never
// formed) against the libtorch path (bmm's bf16 products with fp32 outputs, softmax, head mean,
// pools) on the same bf16 inputs: the same products and fp32 sums in another order, so the KL
// within 1e-5 and the gradients within 2e-3 of the largest (a bf16 rounding flipped here and
// there). Shapes: GQA 24/8 and 4/4; block sizes that divide nothing, 1024 (one block of 1000
// rows: row and key tiles cut at the end), 16; two batch rows.
TEST(DsaIndexer, DenseWarmupTargetKernelEqualsTheLibtorchPath_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  struct Case {
    int64_t B, H, Hkv, S, block;
  };
  const int64_t HI = 4, DI = 64, D = 128;
  for (const Case& c : {Case{2, 24, 8, 1000, 37}, Case{2, 24, 8, 1000, 1024}, Case{1, 4, 4, 260, 16}}) {
    torch::manual_seed(97);
    const auto bf = torch::TensorOptions().dtype(torch::kBFloat16).device(torch::kCUDA);
    const int64_t P = c.S / 4;
    const Tensor qi = torch::randn({c.B, HI, c.S, DI}, bf), keys = torch::randn({c.B, P, DI}, bf);
    const Tensor w = torch::randn({c.B, c.S, HI}, bf), q = torch::randn({c.B, c.H, c.S, D}, bf) * 2;
    const Tensor k = torch::randn({c.B, c.Hkv, c.S, D}, bf);
    Tensor value[2], dq[2], dk[2], dw[2];
    for (int kernel : {0, 1}) {
      SetFusedKernels(kernel == 1);
      Tensor q1 = qi.clone().requires_grad_(true), k1 = keys.clone().requires_grad_(true),
             w1 = w.clone().requires_grad_(true);
      value[kernel] = DenseWarmupKl(q1, k1, w1, q, k, c.block);
      value[kernel].backward();
      value[kernel] = value[kernel].detach();
      dq[kernel] = q1.grad().to(torch::kFloat32), dk[kernel] = k1.grad().to(torch::kFloat32);
      dw[kernel] = w1.grad().to(torch::kFloat32);
    }
    SetFusedKernels(true);
    const std::string name = "B " + std::to_string(c.B) + " H " + std::to_string(c.H) + "/" + std::to_string(c.Hkv) +
                             " block " + std::to_string(c.block);
    EXPECT_NEAR(value[1].item<double>(), value[0].item<double>(), 1e-5 * std::abs(value[0].item<double>())) << name;
    EXPECT_LT(RelErr(dq[1], dq[0]), 2e-3) << name << " dq";
    EXPECT_LT(RelErr(dk[1], dk[0]), 2e-3) << name << " dk";
    EXPECT_LT(RelErr(dw[1], dw[0]), 2e-3) << name << " dw";
  }
}

TEST(DsaIndexer, KlLossKernelWithinTwiceTheLibtorchError_cuda) {
  if (!torch::cuda::is_available() || !FusedKernelsBuilt()) {
    GTEST_SKIP() << (torch::cuda::is_available() ? "a build without ODYSSEY_CUDA kernels" : "no CUDA device");
  }
  struct Case {
    int64_t B, HI, S, DI, kp;
  };
  for (const Case& c : {Case{1, 32, 300, 128, 40}, Case{2, 8, 203, 64, 21}}) {
    const std::string name = "HI " + std::to_string(c.HI) + " DI " + std::to_string(c.DI);
    torch::manual_seed(81);
    auto r16 = [](const Tensor& t) { return t.to(torch::kBFloat16).to(torch::kFloat64); };
    const Tensor q = r16(torch::randn({c.B, c.HI, c.S, c.DI}, torch::kFloat64));
    const Tensor keys = r16(torch::randn({c.B, c.S / 4, c.DI}, torch::kFloat64));
    const Tensor w = r16(torch::randn({c.B, c.S, c.HI}, torch::kFloat64) / std::sqrt(double(c.HI)));
    DsaIndexerOptions o;
    o.top_k = c.kp;
    o.pool = 4;
    Tensor pool = IndexerTopK(q, keys, w, o);  // (B, S, kp) int32
    pool.select(1, c.S - 1).select(1, 3).fill_(-1);
    const Tensor valid = pool >= 0;
    ASSERT_EQ(valid.select(2, 0).logical_not().sum().item<int64_t>(), 3 * c.B);  // rows 0..2: no pool
    Tensor target = torch::rand(pool.sizes(), torch::kFloat64).masked_fill(valid.logical_not(), 0.0);
    target = (target / target.sum(-1, true).clamp_min(1e-30)).to(torch::kFloat32).to(torch::kFloat64);
    auto leaf = [](const Tensor& t) { return t.detach().clone().requires_grad_(true); };
    std::vector<Tensor> truth;
    {
      Tensor q0 = leaf(q), k0 = leaf(keys), w0 = leaf(w);
      Tensor l = IndexerKlLoss(q0, k0, w0, pool, target);
      (l * 2.5).backward();
      truth = {l.detach(), q0.grad(), k0.grad(), w0.grad()};
    }
    auto run = [&](bool fused) {
      SetFusedKernels(fused);
      auto dev = [&](const Tensor& t) { return leaf(t.to(torch::kCUDA, torch::kBFloat16)); };
      Tensor q1 = dev(q), k1 = dev(keys), w1 = dev(w);
      const int64_t launches = FusedKernelLaunches();
      Tensor l = IndexerKlLoss(q1, k1, w1, pool.cuda(), target.to(torch::kCUDA, torch::kFloat32));
      (l * 2.5).backward();
      EXPECT_EQ(FusedKernelLaunches() - launches >= 2, fused) << name << ": the kernels ran " << fused;
      SetFusedKernels(true);
      auto back = [](const Tensor& t) { return t.detach().cpu().to(torch::kFloat64); };
      return std::vector<Tensor>{back(l), back(q1.grad()), back(k1.grad()), back(w1.grad())};
    };
    const std::vector<Tensor> ref = run(false), got = run(true);
    const char* names[] = {"loss", "dq", "dk", "dw"};
    for (int i = 0; i < 4; ++i) {
      const double scale = truth[i].abs().max().item<double>();
      EXPECT_GT(scale, 0.0) << name << " " << names[i];
      EXPECT_LE(MaxErr(got[i], truth[i]), 2 * MaxErr(ref[i], truth[i]) + 8 * FLT_EPSILON * scale)
          << name << " " << names[i];
    }
  }
}

// The error names the argument and the rule.
void ExpectThrowNaming(const std::function<void()>& f, const std::string& what) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << what;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(what), std::string::npos) << e.what_without_backtrace();
  }
}

TEST(DsaSparseAttention, RejectsIndicesOutOfRange) {
  Qkv x = MakeQkv(1, 2, 1, 8, 4, 4, 27);
  Tensor idx = torch::full({1, 8, 2}, 8, torch::kInt32);
  EXPECT_THROW(SparseAttention(x.q, x.k, x.v, idx), c10::Error);
  // Sk = 5 keys for 8 queries: the bound is k's rows, not q's.
  const Tensor k5 = x.k.narrow(2, 0, 5), v5 = x.v.narrow(2, 0, 5);
  ExpectThrowNaming([&] { SparseAttentionForward(x.q, k5, v5, torch::full({1, 8, 2}, 5, torch::kInt32)); },
                    "indices must lie in [-1, Sk)");
  const Tensor ok = torch::full({1, 8, 2}, 4, torch::kInt32);
  EXPECT_EQ(SparseAttention(x.q, k5, v5, ok).sizes(), torch::IntArrayRef({1, 2, 8, 4}));
  ExpectThrowNaming([&] { SparseAttention(x.q, k5, x.v, ok); }, "v must be (B, Hkv, Sk, Dv)");
  const SparseAttentionResult r = SparseAttentionForward(x.q, k5, v5, ok);
  Tensor dk = torch::zeros({1, 1, 5, 4}, torch::kFloat64), dv = torch::zeros({1, 1, 5, 4}, torch::kFloat64);
  Tensor dk32 = dk.to(torch::kFloat32), dk_short = torch::zeros({1, 1, 4, 4}, torch::kFloat64);
  const Tensor dO = torch::ones({1, 2, 8, 4}, torch::kFloat64);
  ExpectThrowNaming([&] { SparseAttentionBackward(dO, x.q, k5, v5, ok, r.lse, 0.0, dk32, dv); }, "dk_acc must be");
  ExpectThrowNaming([&] { SparseAttentionBackward(dO, x.q, k5, v5, ok, r.lse, 0.0, dk_short, dv); }, "dk_acc must be");
  ExpectThrowNaming([&] { SparseAttentionBackward(dO, x.q, k5, v5, ok, r.lse.to(torch::kFloat32), 0.0, dk, dv); },
                    "lse must be (B, H, Sq)");
  ExpectThrowNaming([&] { SparseAttentionBackward(dO.narrow(2, 0, 5), x.q, k5, v5, ok, r.lse, 0.0, dk, dv); },
                    "grad_out must be (B, H, Sq, Dv)");
  // The KL target's probabilities read k at the indices too.
  ExpectThrowNaming([&] { SparseAttentionProbs(x.q, k5, torch::full({1, 8, 2}, 5, torch::kInt32)); },
                    "SparseAttentionProbs: indices must lie in [-1, Sk)");
  ExpectThrowNaming([&] { SparseAttentionProbs(x.q, k5, torch::full({1, 8, 2}, -2, torch::kInt32)); },
                    "indices must lie in [-1, Sk)");
  EXPECT_EQ(SparseAttentionProbs(x.q, k5, ok).sizes(), torch::IntArrayRef({1, 8, 2}));
}

}  // namespace
}  // namespace odyssey::kernels
