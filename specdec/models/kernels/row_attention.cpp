// Attention for the new tokens of a decode or verification step (and of a causal prefill chunk), every row on its own,
// AVX-512 or AVX2 with FMA (simd.h: the same bits on either; the tiles below are sized to each one's registers): RoPE,
// the KV-cache write and the attention of a layer in one call (one call per layer and sequence replaces a dozen
// PyTorch ops and an attention call per row).
//
// Row i (a new token) attends to the cached keys 0 … cached − 1, then to the new tokens it sees: 0 … i (causal) or
// its tree path (ancestors, then itself). Every (row, query head) is computed by the same fixed sequence of
// operations whatever else is in the call: a score is its query's and key's products folded per lane over the
// dimensions in order, then summed across lanes by a fixed tree; the softmax and the sum over the values run over
// the row's keys in order. So a row's result depends only on its query and the keys and values it sees, never on
// the other rows or the thread count (batch invariance: a verified row is bitwise the one-token step's).
// What the rows share is read once: a work item is one KV head and a block of rows; it scores sixteen keys at a
// time for all its rows and query heads (a tile of up to six heads × four keys reuses each load of a key across
// the heads and of a query across the keys; with several rows, the block is transposed once and every query
// folds each lane of dimensions for all sixteen keys at once), and folds the values in blocks that stay in
// cache while every row and head of the item takes its share. Values are read in runs contiguous in memory (the
// cache, then the new tokens; a tree row's path is gathered first), with no table of pointers: against the table
// per row and block, 0.93–0.99 of the attention's time at 2–16 rows, one row 0.99 (context 1024, 28 layers,
// paired rounds, bitwise equal).
// A scoring tile of 6 queries × 64 keys (one chain per lane of dimensions for 24 accumulators, its lane tree through
// L1) ran no faster than the 4-query tile below, alone in L1 (88 against 92 G MAC/s a core) or in the kernel, and
// its transposition of 64 keys cost more at 2–4 rows: not kept.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "kernel_entry.h"
#include "simd.h"

namespace {

namespace simd = specdec::simd;
using simd::exp_nonpositive;
using simd::kLanes;
using simd::lane_mask;

constexpr int kChunks = 8;            // vectors per block of a head's dimensions (≤ 128 floats)
constexpr int kKeyBlock = 16;         // keys lane-summed together
// keys × heads of a scoring tile: ≤ 24 accumulators, + the heads' query chunks (AVX2: 4 vectors of two ymm)
constexpr int kTileKeys = simd::kWide ? 4 : 2;
constexpr int kTileHeads = simd::kWide ? 6 : 2;
// Values are folded by tiles of heads × zmm of dimensions. An item of one row (plain decoding) takes 3 heads × 8
// zmm, whole value rows, which stream from memory in order (one row at context 1024, cold: 6–27% faster than the
// 6 × 4 tile over four runs); items of several rows take 6 heads × 4 zmm (24 accumulators + 4 values, no spill;
// 0–13% faster than 3 × 8 at 16 rows). AVX2 takes 2 heads × 2 vectors for one row and 3 × 2 for several (12 ymm of
// accumulators: 0.87–0.98 of the time of 2 × 2 at 2–16 rows, context 1024, and 0.94–0.96 at 4–16 rows, context 128,
// two runs; 3 × 1 and 6 × 1 took 0.92–1.08, and one row neither gained nor lost with 3 × 2). Each output is the same
// chain of fused multiply-adds in any tile.
constexpr int kRowValueHeads = simd::kWide ? 3 : 2, kRowValueChunks = simd::kWide ? 8 : 2;
constexpr int kBlockValueHeads = simd::kWide ? 6 : 3, kBlockValueChunks = simd::kWide ? 4 : 2;
// Values per visit of the accumulators: 32 for one row (16 KiB at D = 128: stays in L1; 64–256 took 0.99–1.11× the
// time on a Zen 4 host); items of several rows take 256 (128 KiB, which each row re-reads from L2), an eighth of the
// accumulators' loads and stores between blocks of 32. Against 32, 64 took 0.93–0.96 of the time (attention alone,
// 28 layers, context 1024, 8 / 16 rows, three runs; Zen 5 host, 48 KiB L1; 256 not measured there). On a Zen 4 host
// (32 KiB L1, which 64 values fill) 64 took 8.8–8.9 ms at 8 rows in two runs and 11.1 in another, 256 8.4–9.3:
// against 64, 256 took 0.95–0.96 of the time at 8–16 rows and 0.96–0.98 at 4 in the two, 0.83–0.84 and 0.88 in the
// other (attention alone, context 1024, caches flushed, paired shuffled rounds, bitwise equal); 128 took 0.96–0.97
// and 0.89–0.93, 512 no less than 256. Real 1.5B forwards at context 1024 (paired, bitwise equal): int8 k = 6 / 8
// 0.979 / 0.970 of the time, float32 k = 8 0.984, k = 2–4 1.00; int8 at context 128: 0.99–1.01 at k = 4–16.
constexpr int64_t kRowValueBlock = 32, kBlockValueBlock = 256;
// Items of two or more rows score each block of cached keys from one transposition of it (transpose_keys,
// transposed_scores: the same sums, bitwise): with the rows' and heads' queries sharing it, its cost is a fraction
// of the lane sums it replaces (attention alone, 28 layers, context 1024: 1–6% faster at 8 rows, 6–13% at 16); one
// row alone keeps partial_scores (transposing for six queries cost more: 4.98 against 4.25 ms at context 1024).
constexpr int kTransposedMinRows = 2;
// queries per tile: 2 chains each + the tree's partial sums + 2 key rows (AVX2: one query, 7 vectors of two ymm)
constexpr int kTransposedQueries = simd::kWide ? 4 : 1;
// A work item takes at most this many rows (a prefill chunk: many items), so that its scores (rows × heads × keys)
// stay in L2; its rows share the transposition of every key block they all see, the chunk's tokens before its first
// row included. A 512-token chunk's attention (the 1.5B's heads, two threads; Intel host), against one item per KV
// head, each row bitwise a one-token step's either way: 3.95 against 7.97 ms after no cached tokens, 11.85 against
// 15.08 after 512; items of 16 rows 4.09 / 13.36, of 64 rows 4.17 / 12.70; of 32 rows transposing cached blocks only,
// 4.54 / 12.86. PyTorch's attention over the same chunk (a float mask made once): 7.27 / 15.30. The 1.5B's TTFT over a
// 1,016-token prompt (two chunks), against PyTorch's attention: 0.76–0.84 of the time in int8, 0.93–0.96 in float32.
constexpr int64_t kMaxItemRows = 32;
// Every item prefetches the next block of cached keys (values) into L2 while it scores (folds) one, a few lines at
// each step of the arithmetic (Prefetcher). A block's lines prefetched at once stall the loads queued behind them
// until memory answers, so the stream hardly overlapped the arithmetic: from memory an item cost about its time in
// cache plus the stream's (attention alone, 28 layers, caches flushed between layers, context 1024, 1 / 2 / 8 / 16
// rows: 4.7 / 7.0 / 15.1 / 22.3 ms against 2.1 / 3.1 / 9.8 / 18.4 from cache). Spread out, at context 1024: 0.70–0.78
// / 0.60–0.62 / 0.65–0.82 / 0.89–1.02 of the burst's time (one row had no prefetch before: the hardware's alone);
// context 300: 0.98–1.00 / 0.73–0.78 / 0.84–0.87; one row at context 64–200: 0.96–1.07.

// The cached keys or values of a KV head (d floats per token) fetched into L2 ahead of their use, spread over the
// steps of the arithmetic: aim() sets how far to fetch and over how many steps
class Prefetcher {
 public:
  Prefetcher(const float* tokens, int64_t d, int64_t first)
      : tokens_(reinterpret_cast<const char*>(tokens)), token_bytes_(d * sizeof(float)),
        next_(tokens_ + first * token_bytes_), stop_(next_) {}
  // the lines up to token `end` not yet fetched, over the next `steps` (≥ 1) calls of step()
  void aim(int64_t end, int64_t steps) {
    stop_ = std::max(stop_, tokens_ + end * token_bytes_);
    const int64_t lines = (stop_ - next_ + 63) / 64;
    rate_ = (lines * kOne + steps - 1) / steps;
  }
  void step() {
    for (credit_ += rate_; credit_ >= kOne && next_ < stop_; credit_ -= kOne, next_ += 64)
      _mm_prefetch(next_, _MM_HINT_T1);
    if (next_ >= stop_) credit_ = 0;
  }

 private:
  static constexpr int64_t kOne = 256;  // a line, in the rate's fixed point
  const char* tokens_;
  int64_t token_bytes_;
  const char* next_;
  const char* stop_;
  int64_t rate_ = 0, credit_ = 0;
};

// a vector of floats; masked only where the head dimension is not a whole number of blocks
template <bool MASKED>
simd::Vec load(simd::Mask mask, const float* p) {
  if constexpr (MASKED) return simd::load(mask, p);
  return simd::load(p);
}

// Sixteen vectors' lane sums in one vector (lane t: the sum of v[t]), each by the same addition tree whatever its
// slot: pairs within 128-bit quarters, then the quarter, then the quarters pairwise (transposed_scores adds the
// lanes by this same tree: a change here is a change there)
simd::Vec lane_sums(const float* partial) {
  simd::Vec v[kLanes], x[8], y[4];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) v[i] = simd::load(partial + i * kLanes);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    x[i] = simd::add(simd::unpack_low(v[2 * i], v[2 * i + 1]), simd::unpack_high(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    y[i] = simd::add(simd::shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(x[2 * i], x[2 * i + 1]),
                     simd::shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(x[2 * i], x[2 * i + 1]));
  const simd::Vec u0 = simd::add(simd::even_quarters(y[0], y[1]), simd::odd_quarters(y[0], y[1]));
  const simd::Vec u1 = simd::add(simd::even_quarters(y[2], y[3]), simd::odd_quarters(y[2], y[3]));
  return simd::add(simd::even_quarters(u0, u1), simd::odd_quarters(u0, u1));
}

// partial[h][t] (sixteen floats each) = q_h · k_t folded per lane over the dimensions in order (fused
// multiply-adds), for HEADS heads (queries d floats apart) and the sixteen keys key[t]
template <int HEADS, int CHUNKS, bool MASKED>
void partial_scores(const float* q, int64_t d, const float* const* key, float* partial, Prefetcher& prefetcher) {
  Prefetcher ahead = prefetcher;  // a local copy stays in registers across the loop
  for (int t0 = 0; t0 < kKeyBlock; t0 += kTileKeys) {
    simd::Vec acc[HEADS][kTileKeys];
#pragma GCC unroll 6
    for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 4
      for (int t = 0; t < kTileKeys; ++t) acc[h][t] = simd::zero();
    for (int64_t base = 0; base < d; base += CHUNKS * kLanes) {
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) {
        ahead.step();
        const int64_t offset = base + c * kLanes;
        const simd::Mask mask = lane_mask(d - offset);
        simd::Vec qv[HEADS];
#pragma GCC unroll 6
        for (int h = 0; h < HEADS; ++h) qv[h] = load<MASKED>(mask, q + h * d + offset);
#pragma GCC unroll 4
        for (int t = 0; t < kTileKeys; ++t) {
          const simd::Vec kv = load<MASKED>(mask, key[t0 + t] + offset);
#pragma GCC unroll 6
          for (int h = 0; h < HEADS; ++h) acc[h][t] = simd::fmadd(qv[h], kv, acc[h][t]);
        }
      }
    }
#pragma GCC unroll 6
    for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 4
      for (int t = 0; t < kTileKeys; ++t) simd::store(partial + (h * kKeyBlock + t0 + t) * kLanes, acc[h][t]);
  }
  prefetcher = ahead;
}

// kt [CHUNKS · 16][16]: sixteen keys (key[t] + offset …, sixteen floats of each) transposed, dimension-major, so
// that a vector holds one dimension of all sixteen keys
void transpose_keys(const float* const* key, int64_t offset, float* kt) {
  simd::Vec r[kLanes], t[kLanes], u[kLanes];
#pragma GCC unroll 16
  for (int i = 0; i < kLanes; ++i) r[i] = simd::load(key[i] + offset);
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = simd::unpack_low(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = simd::unpack_high(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {  // keys 4i … 4i + 3: dimensions c, c + 4, c + 8, c + 12 of u[4i + c]
    u[4 * i] = simd::shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = simd::shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = simd::shuffle<_MM_SHUFFLE(1, 0, 1, 0)>(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = simd::shuffle<_MM_SHUFFLE(3, 2, 3, 2)>(t[4 * i + 1], t[4 * i + 3]);
  }
  // keys 8h … 8h + 7: dimensions c, c + 8 of t[8h + c], and c + 4, c + 12 of t[8h + 4 + c]
#pragma GCC unroll 2
  for (int h = 0; h < 2; ++h)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) {
      t[8 * h + c] = simd::even_quarters(u[8 * h + c], u[8 * h + 4 + c]);
      t[8 * h + 4 + c] = simd::odd_quarters(u[8 * h + c], u[8 * h + 4 + c]);
    }
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {  // all sixteen keys: dimensions c and c + 8
    simd::store(kt + c * kLanes, simd::even_quarters(t[c], t[8 + c]));
    simd::store(kt + (c + 8) * kLanes, simd::odd_quarters(t[c], t[8 + c]));
  }
}

// scale · (q_g · k_t) for QUERIES queries q[g] and the sixteen keys transposed in kt, into out[g][0 … 16): the same
// sums as partial_scores and lane_sums (each lane's products folded over the dimensions in order, then the lanes
// summed by the same tree), computed a lane of dimensions at a time for all sixteen keys, so one transposition of
// the keys serves every query and no partial sums go through memory
template <int QUERIES, int CHUNKS>
void transposed_scores(const float* const* q, const float* kt, float scale, float* const* out, Prefetcher& prefetcher) {
  Prefetcher ahead = prefetcher;  // a local copy stays in registers across the loop
  simd::Vec quarters[QUERIES][2];  // the tree's (quarter 0 + 1) and quarter 2
#pragma GCC unroll 4
  for (int quarter = 0; quarter < 4; ++quarter) {
    simd::Vec pairs[QUERIES];
#pragma GCC unroll 2
    for (int pair = 0; pair < 2; ++pair) {
      ahead.step();
      const int la = 4 * quarter + pair, lb = la + 2;  // the tree adds lanes l and l + 2 first
      simd::Vec a[QUERIES], b[QUERIES];
#pragma GCC unroll 6
      for (int g = 0; g < QUERIES; ++g) a[g] = b[g] = simd::zero();
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) {
        const simd::Vec ka = simd::load(kt + (c * kLanes + la) * kLanes);
        const simd::Vec kb = simd::load(kt + (c * kLanes + lb) * kLanes);
#pragma GCC unroll 6
        for (int g = 0; g < QUERIES; ++g) {
          a[g] = simd::fmadd(simd::broadcast(q[g][c * kLanes + la]), ka, a[g]);
          b[g] = simd::fmadd(simd::broadcast(q[g][c * kLanes + lb]), kb, b[g]);
        }
      }
#pragma GCC unroll 6
      for (int g = 0; g < QUERIES; ++g) {
        const simd::Vec sum = simd::add(a[g], b[g]);
        pairs[g] = pair == 0 ? sum : simd::add(pairs[g], sum);
      }
    }
#pragma GCC unroll 6
    for (int g = 0; g < QUERIES; ++g) {
      if (quarter == 0 || quarter == 2) quarters[g][quarter / 2] = pairs[g];
      else if (quarter == 1) quarters[g][0] = simd::add(quarters[g][0], pairs[g]);
      else {
        const simd::Vec total = simd::add(quarters[g][0], simd::add(quarters[g][1], pairs[g]));
        simd::store(out[g], simd::mul(total, simd::broadcast(scale)));
      }
    }
  }
  prefetcher = ahead;
}

// out_h += Σ_j p_h[j] · v_j for the `count` values v_j = value + j · d and HEADS heads (p_h = p + h · stride,
// out_h = out + h · d), folded over j in order per dimension; `first`: out_h starts from zero. The running sums wait
// in out between runs of values (a float stored and loaded back is exact), so each is one chain over all the values.
template <int HEADS, int CHUNKS, bool MASKED>
void fold_values(const float* p, int64_t stride, const float* value, int64_t count, int64_t d, bool first,
                 float* out, Prefetcher& prefetcher) {
  Prefetcher ahead = prefetcher;  // a local copy stays in registers across the loop
  for (int64_t base = 0; base < d; base += CHUNKS * kLanes) {
    simd::Mask masks[CHUNKS];
    simd::Vec acc[HEADS][CHUNKS];
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) {
      masks[c] = lane_mask(d - base - c * kLanes);
#pragma GCC unroll 6
      for (int h = 0; h < HEADS; ++h)
        acc[h][c] = first ? simd::zero() : simd::load(masks[c], out + h * d + base + c * kLanes);
    }
    const float* v = value + base;
    for (int64_t j = 0; j < count; ++j, v += d) {
      ahead.step();
      simd::Vec vv[CHUNKS];
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) vv[c] = load<MASKED>(masks[c], v + c * kLanes);
#pragma GCC unroll 6
      for (int h = 0; h < HEADS; ++h) {
        const simd::Vec ph = simd::broadcast(p[h * stride + j]);
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; ++c) acc[h][c] = simd::fmadd(ph, vv[c], acc[h][c]);
      }
    }
#pragma GCC unroll 6
    for (int h = 0; h < HEADS; ++h)
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) simd::store(out + h * d + base + c * kLanes, masks[c], acc[h][c]);
  }
  prefetcher = ahead;
}

// p = exp(s − max s) in place over s[0, length); returns 1 / Σ p
float softmax_numerators(float* s, int64_t length) {
  simd::Vec vmax = simd::broadcast(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < length; j += kLanes) vmax = simd::max(vmax, simd::load(lane_mask(length - j), vmax, s + j));
  const simd::Vec smax = simd::broadcast(simd::reduce_max(vmax));
  simd::Vec vsum = simd::zero();
  for (int64_t j = 0; j < length; j += kLanes) {
    const simd::Mask m = lane_mask(length - j);
    const simd::Vec e = simd::keep(m, exp_nonpositive(simd::sub(simd::load(m, s + j), smax)));
    simd::store(s + j, m, e);
    vsum = simd::add(vsum, e);
  }
  return 1.0f / simd::reduce_add(vsum);
}

// x [heads, D] rotated by RoPE into out: x · cos + rotate_half(x) · sin, each product rounded and then summed, as
// PyTorch's elementwise ops compute it (built without contraction into fused multiply-adds), so keys written here
// are bitwise those the PyTorch path writes
void rotate(const float* x, const float* cos, const float* sin, int64_t heads, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h, x += d, out += d) {
    for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
    for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
  }
}

using PartialScores = void (*)(const float*, int64_t, const float* const*, float*, Prefetcher&);
using TransposedScores = void (*)(const float* const*, const float*, float, float* const*, Prefetcher&);
using FoldValues = void (*)(const float*, int64_t, const float*, int64_t, int64_t, bool, float*, Prefetcher&);

// How an item folds its values: tiles of up to `heads` heads × `chunks` zmm, over blocks of `block` values
struct ValueTiling {
  int64_t heads, chunks, block;
  const FoldValues* folds;  // [heads]: the tile of h + 1 heads
};

// the tiles of 1 … sizeof...(N) heads (queries)
template <int CHUNKS, bool MASKED, int... N>
constexpr std::array<PartialScores, sizeof...(N)> score_tiles(std::integer_sequence<int, N...>) {
  return {&partial_scores<N + 1, CHUNKS, MASKED>...};
}
template <int CHUNKS, int... N>
constexpr std::array<TransposedScores, sizeof...(N)> transposed_tiles(std::integer_sequence<int, N...>) {
  return {&transposed_scores<N + 1, CHUNKS>...};
}
template <int CHUNKS, bool MASKED, int... N>
constexpr std::array<FoldValues, sizeof...(N)> fold_tiles(std::integer_sequence<int, N...>) {
  return {&fold_values<N + 1, CHUNKS, MASKED>...};
}

template <int CHUNKS, bool MASKED>
struct Kernels {
  static constexpr auto scores = score_tiles<CHUNKS, MASKED>(std::make_integer_sequence<int, kTileHeads>{});
  static constexpr int kRowChunks = std::min(CHUNKS, kRowValueChunks);
  static constexpr int kBlockChunks = std::min(CHUNKS, kBlockValueChunks);
  static constexpr auto row_values = fold_tiles<kRowChunks, MASKED>(std::make_integer_sequence<int, kRowValueHeads>{});
  static constexpr auto transposed = transposed_tiles<CHUNKS>(std::make_integer_sequence<int, kTransposedQueries>{});
  static constexpr auto block_values =
      fold_tiles<kBlockChunks, MASKED>(std::make_integer_sequence<int, kBlockValueHeads>{});
  static constexpr ValueTiling row_tiling{kRowValueHeads, kRowChunks, kRowValueBlock, row_values.data()};
  static constexpr ValueTiling block_tiling{kBlockValueHeads, kBlockChunks, kBlockValueBlock, block_values.data()};
};

// A thread's working memory, kept across its items and grown as needed, never initialized: each item writes what it
// reads (sixteen rows' scores at context 1024 are ~0.4 MB a KV head)
class Scratch {
 public:
  float* floats(int64_t count) {
    if (count > size_) data_.reset(new float[count]), size_ = count;
    return data_.get();
  }

 private:
  std::unique_ptr<float[]> data_;
  int64_t size_ = 0;
};

// The rows a work item attends for one KV head: row r sees the `cached` keys, then the new tokens at tail(r)
struct Rows {
  int64_t cached;
  const std::vector<std::vector<int64_t>>* paths;  // empty: causal
  bool on_path(int64_t row) const { return !paths->empty() && !(*paths)[row].empty(); }  // else its own prefix
  int64_t seen(int64_t row) const { return on_path(row) ? static_cast<int64_t>((*paths)[row].size()) : row + 1; }
  int64_t length(int64_t row) const { return cached + seen(row); }
  int64_t position(int64_t row, int64_t j) const {  // the cache position of the row's j-th key
    return j < cached || !on_path(row) ? j : cached + (*paths)[row][j - cached];
  }
};

// One work item: rows [r0, r1) of the KV head whose keys and values start at keys, values (one token each d floats
// apart); q: the rotated queries [n, heads, d]; out [n, heads · d]
template <int CHUNKS, bool MASKED>
void attend_item(const Rows& rows, int64_t r0, int64_t r1, int64_t kvh, int64_t heads, int64_t group, int64_t d,
                 const float* q, const float* keys, const float* values, float scale, Scratch& scratch,
                 float* out) {
  using K = Kernels<CHUNKS, MASKED>;
  int64_t longest = 0;
  for (int64_t r = r0; r < r1; ++r) longest = std::max(longest, rows.length(r));
  const int64_t stride = (longest + kKeyBlock - 1) / kKeyBlock * kKeyBlock;  // floats per (row, head) of scores
  const int64_t count = r1 - r0;
  // a tree row's values after the cache (its path), gathered in order: `tail` tokens a row; causal rows read theirs
  // from the cache
  const int64_t tail = rows.paths->empty() ? 0 : longest - rows.cached;
  // one buffer per thread, kept across its items (64-byte aligned): partial sums, a transposed key block, scores,
  // 1 / Σ p per (row, head), the tails
  constexpr int64_t kPartial = kTileHeads * kKeyBlock * kLanes;
  constexpr int64_t kTransposedKeys = CHUNKS * kLanes * kLanes;
  float* buffer = scratch.floats(kLanes + kPartial + kTransposedKeys + count * group * (stride + 1) + count * tail * d);
  float* partial = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buffer) + 63) & ~uintptr_t{63});
  float* kt = partial + kPartial;
  float* scores = kt + kTransposedKeys;
  float* inverses = scores + count * group * stride;
  float* tails = inverses + count * group;
  for (int64_t r = r0; r < r1; ++r)
    if (rows.on_path(r))
      for (int64_t j = 0; j < rows.seen(r); ++j)
        std::memcpy(tails + ((r - r0) * tail + j) * d, values + rows.position(r, rows.cached + j) * d, d * sizeof(float));
  const float* pointers[kKeyBlock];
  // scores, sixteen keys at a time for every row and head (the keys stay in L1 from the first row to the last)
  const bool transposed = !MASKED && count >= kTransposedMinRows;
  // steps of the arithmetic per block: a transposed block's query tiles × 8, or per row and tile of heads, 4 key
  // tiles × d / 16 lanes; values: per row and tile of heads, the block's values × the tile's passes over d
  const int64_t queries = count * group;
  const int64_t transposed_steps = (queries + kTransposedQueries - 1) / kTransposedQueries * 8;
  const int64_t partial_steps = count * ((group + kTileHeads - 1) / kTileHeads) * (kKeyBlock / kTileKeys) * ((d + kLanes - 1) / kLanes);
  const ValueTiling& tiling = count == 1 ? K::row_tiling : K::block_tiling;
  const int64_t value_steps = count * ((group + tiling.heads - 1) / tiling.heads) * tiling.block *
                              ((d + tiling.chunks * kLanes - 1) / (tiling.chunks * kLanes));
  // keys every row of the item sees, whose blocks are transposed once for all of them: the cache, and for causal rows
  // the new tokens up to the item's first row
  const int64_t shared_keys = rows.paths->empty() ? rows.cached + r0 + 1 : rows.cached;
  Prefetcher ahead_keys(keys, d, std::min<int64_t>(rows.cached, kKeyBlock));
  for (int64_t j0 = 0; j0 < longest; j0 += kKeyBlock) {
    const bool block_transposed = transposed && j0 + kKeyBlock <= shared_keys;
    ahead_keys.aim(std::min(rows.cached, j0 + 2 * kKeyBlock), block_transposed ? transposed_steps : partial_steps);
    if (block_transposed) {  // a block of keys that every row sees
      for (int t = 0; t < kKeyBlock; ++t) pointers[t] = keys + (j0 + t) * d;
      for (int c = 0; c < CHUNKS; ++c) transpose_keys(pointers, c * kLanes, kt + c * kLanes * kLanes);
      // the item's queries in order: (row r, head h), h fastest
      for (int64_t i0 = 0, r = r0, h = 0; i0 < queries; i0 += kTransposedQueries) {
        const int tile = static_cast<int>(std::min<int64_t>(kTransposedQueries, queries - i0));
        const float* qs[kTransposedQueries];
        float* outs[kTransposedQueries];
        for (int i = 0; i < tile; ++i) {
          qs[i] = q + (r * heads + kvh * group + h) * d;
          outs[i] = scores + ((r - r0) * group + h) * stride + j0;
          if (++h == group) h = 0, ++r;
        }
        K::transposed[tile - 1](qs, kt, scale, outs, ahead_keys);
      }
      continue;
    }
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t length = rows.length(r);
      if (j0 >= length) continue;
      // keys past the row's end: its first key (scored, not stored)
      for (int t = 0; t < kKeyBlock; ++t)
        pointers[t] = keys + (j0 + t < length ? rows.position(r, j0 + t) : rows.position(r, 0)) * d;
      const float* qr = q + (r * heads + kvh * group) * d;
      float* sr = scores + (r - r0) * group * stride;
      for (int64_t h0 = 0; h0 < group; h0 += kTileHeads) {
        const int tile = static_cast<int>(std::min<int64_t>(kTileHeads, group - h0));
        K::scores[tile - 1](qr + h0 * d, d, pointers, partial, ahead_keys);
        for (int h = 0; h < tile; ++h)
          simd::store(sr + (h0 + h) * stride + j0, lane_mask(length - j0),
                      simd::mul(lane_sums(partial + h * kKeyBlock * kLanes), simd::broadcast(scale)));
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t g = 0; g < group; ++g)
      inverses[(r - r0) * group + g] = softmax_numerators(scores + ((r - r0) * group + g) * stride, rows.length(r));
  // values, a block at a time for every row and head (the first block's lines fetched at once)
  Prefetcher ahead_values(values, d, 0);
  ahead_values.aim(std::min(rows.cached, tiling.block), 1);
  ahead_values.step();
  for (int64_t j0 = 0; j0 < longest; j0 += tiling.block) {
    ahead_values.aim(std::min(rows.cached, j0 + 2 * tiling.block), value_steps);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t length = rows.length(r), end = std::min(length, j0 + tiling.block);
      if (j0 >= length) continue;
      // the block in runs of values contiguous in memory: the cache up to the row's tail, which is contiguous too
      // when causal, else gathered
      const bool gathered = rows.on_path(r);
      for (int64_t run = j0; run < end;) {
        const int64_t run_end = gathered && run < rows.cached ? std::min(end, rows.cached) : end;
        const float* source = gathered && run >= rows.cached ? tails + ((r - r0) * tail + run - rows.cached) * d
                                                             : values + run * d;
        const float* sr = scores + (r - r0) * group * stride + run;
        float* orow = out + (r * heads + kvh * group) * d;
        for (int64_t h0 = 0; h0 < group; h0 += tiling.heads) {
          const int tile = static_cast<int>(std::min<int64_t>(tiling.heads, group - h0));
          tiling.folds[tile - 1](sr + h0 * stride, stride, source, run_end - run, d, run == 0, orow + h0 * d,
                                 ahead_values);
        }
        run = run_end;
      }
    }
  }
  for (int64_t r = r0; r < r1; ++r) {
    float* orow = out + (r * heads + kvh * group) * d;
    for (int64_t g = 0; g < group; ++g) {
      const simd::Vec inv = simd::broadcast(inverses[(r - r0) * group + g]);
      for (int64_t c = 0; c < d; c += kLanes) {
        const simd::Mask m = lane_mask(d - c);
        simd::store(orow + g * d + c, m, simd::mul(simd::load(m, orow + g * d + c), inv));
      }
    }
  }
}

// One sequence's new tokens through a layer's attention, from its fused projections qkv [n, (H + 2 kvH) · D]
// (q, k, v heads in turn): q and k rotated by RoPE (cos, sin [n, D]), k and v written to the cache (keys and values
// [kvH, ≥ cached + n, D], the sequence's slot in this layer) at cached … cached + n − 1, then each row attends to
// the cached keys and the new tokens it sees: 0 … i, or its tree path paths[i] (ancestors, then itself; all
// empty: causal). scale: on the scores. Returns [n, H · D].
torch::Tensor attend_rows(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor keys,
                          torch::Tensor values, int64_t cached, const std::vector<std::vector<int64_t>>& paths,
                          double scale) {
  for (const auto& t : {qkv, cos, sin, keys, values}) TORCH_CHECK(t.dtype() == torch::kFloat32, "row attention: float32 expected");
  TORCH_CHECK(qkv.dim() == 2 && keys.dim() == 3 && values.dim() == 3, "row attention: qkv [n, W], keys/values [kvH, L, D]");
  const int64_t n = qkv.size(0), kv_heads = keys.size(0), d = keys.size(2);
  TORCH_CHECK(qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous() && cos.sizes() == sin.sizes() &&
                  cos.size(0) == n && cos.size(1) == d && d % 2 == 0,
              "row attention: rows of qkv, and cos and sin [n, D] (D even), expected");
  TORCH_CHECK(keys.stride(2) == 1 && keys.stride(1) == d && values.stride(2) == 1 && values.stride(1) == d &&
                  values.sizes() == keys.sizes(),
              "row attention: keys and values must be [kvH, L, D] with contiguous tokens");
  TORCH_CHECK(qkv.size(1) % d == 0 && qkv.size(1) / d > 2 * kv_heads, "row attention: qkv width");
  const int64_t heads = qkv.size(1) / d - 2 * kv_heads;
  TORCH_CHECK(heads % kv_heads == 0, "row attention: ", heads, " query heads for ", kv_heads, " KV heads");
  TORCH_CHECK(paths.empty() || static_cast<int64_t>(paths.size()) == n, "row attention: one path per row");
  TORCH_CHECK(cached >= 0 && cached + n <= keys.size(1), "row attention: the new tokens end past the cache");
  for (int64_t i = 0; i < static_cast<int64_t>(paths.size()); ++i)
    for (int64_t p : paths[i]) TORCH_CHECK(p >= 0 && p < n, "row attention: path position ", p, " outside the new tokens");
  const int64_t group = heads / kv_heads;
  auto out = torch::empty({n, heads * d}, qkv.options());
  std::vector<float> q(n * heads * d);  // rotated queries
  const float* x = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // whole blocks of dimensions (the usual head sizes) load unmasked
  const auto attend = d == 128 ? &attend_item<8, false> : d == 64 ? &attend_item<4, false> : &attend_item<kChunks, true>;
  const Rows rows{cached, &paths};
  // work items: each KV head's rows in as few blocks of at most kMaxItemRows as keep every thread busy
  const int threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(n * kv_heads)));
  const int64_t blocks_per_head = std::max(std::min<int64_t>(n, (threads + kv_heads - 1) / kv_heads),
                                           (n + kMaxItemRows - 1) / kMaxItemRows);
  const int64_t items = kv_heads * blocks_per_head;
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      const float* row = x + i * qkv.stride(0);
      rotate(row, cp + i * d, sp + i * d, heads, d, q.data() + i * heads * d);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(row + (heads + h) * d, cp + i * d, sp + i * d, 1, d, kp + h * keys.stride(0) + (cached + i) * d);
        std::memcpy(vp + h * values.stride(0) + (cached + i) * d, row + (heads + kv_heads + h) * d, d * sizeof(float));
      }
    }
    Scratch scratch;
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t kvh = item / blocks_per_head, block = item % blocks_per_head;
      const int64_t r0 = n * block / blocks_per_head, r1 = n * (block + 1) / blocks_per_head;
      attend(rows, r0, r1, kvh, heads, group, d, q.data(), kp + kvh * keys.stride(0), vp + kvh * values.stride(0),
             fscale, scratch, op);
    }
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attend", &attend_rows);
  module.attr("attend_entry") = specdec::entry::capsule<specdec::entry::Attend>(&attend_rows);  // kernel_entry.h
}
