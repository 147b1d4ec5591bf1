// float32 linear for decode and verification rows (and prefill chunks), AVX-512F or AVX2 with FMA (simd.h: the same
// sums, bitwise, in tiles sized to each one's registers).
//
// y[m, n] = Σ_k x[m, k] · W[n, k] + b[n], every sum one chain of fused multiply-adds in k order from 0, whatever the
// number of rows or the tiling: a row's result is bitwise the same alone or with others (batch invariance).
// Weights are packed once into panels of 16 output channels, k-major ([N / 16][K][16]), on 2 MiB pages (huge_pages.h):
// a panel is one sequential stream of 64-byte lines, one per k. A tile of MR rows × NR panels keeps MR · NR
// accumulators in registers (≤ 24 zmm; AVX2: ≤ 6 vectors of two ymm) and reads NR streams; the rows' inputs come
// k-major (x transposed once), so a k-step's broadcasts share a line.
// AVX-512: up to 24 rows take one tile (1–4 rows over 4 panels, 5–24 over 1; on Zen 4 1–6 and 7–24, on Intel 1–5
// over 4, 6–12 over 2 and 13–24 over 1), so every weight is read from memory once; more rows take tiles of ≤ 6 rows
// over 4 panels, K cut into chunks that the tiles share from L2 (the partial sums wait in y between chunks: storing
// a float32 and loading it back is exact, so the chain is unchanged). AVX2: 1–3 rows over 2 panels, 4–6 over 1,
// more rows tiles of ≤ 6 rows over 1 panel sharing chunks.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "cpu_family.h"
#include "huge_pages.h"
#include "kernel_entry.h"
#include "shared_work.h"
#include "simd.h"

namespace {

namespace simd = specdec::simd;
using simd::kLanes;                      // channels per panel (one vector)
constexpr int kMaxAccumulators = simd::kWide ? 24 : 6;  // + NR weights and a broadcast: within the registers
constexpr int kMaxPanels = 4;                           // the most panels a tile reads
constexpr int kFewRowPanels = simd::kWide ? 4 : 2;      // panels per tile below kOneStreamRows rows
constexpr int kWidePanels = simd::kWide ? 4 : 1;        // panels per tile when the rows need several tiles
// Calls of five rows and more read one stream per tile (up to 24 rows; more rows, prefill chunks, read four): on a Zen
// 5 host, in the real 1.5B's forwards (every product's kernel swapped, paired shuffled rounds), 5–12 rows took
// 0.69–1.03 of the time over one prefetched stream that they took over 2–4 streams (5: 0.81–1.00, 8: 0.69–0.89, 12:
// 0.98–1.03); 1–4 rows keep four streams: over one, they took 0.90–1.00 of the time with one thread but 1.01–1.06×
// with two in slow memory.
// Calls of kPrefetchMinRows rows and more prefetch their streams into L1: without it, 16 rows (where the arithmetic
// takes as long as the stream) ran ~20% slower, the stream stalling behind the arithmetic. One row leaves its four
// streams to the hardware prefetcher.
// AVX-512 fetches kPrefetchSteps = 128 k-steps (8 KiB) ahead into L1, one prefetch a step and stream. A core streams
// about 40 GB/s alone, what each of the two must stream where memory is fastest, and there the stream and the
// arithmetic overlapped badly with the former 24 steps into L1 and 256 into L2. One thread alone (slow memory, so the
// core bounds it, as both do in fast memory), over the 1.5B's 113 products: 5–6 rows took 0.80–0.90 of the former
// time, 8 rows 0.91–1.01, 12–16 0.94–1.03 (64 steps: 1.08–1.24× at 8–16 rows; 192: 0.84–0.94 at 5–6, 0.90–1.04 at
// 8–16). A plain stream with 8 fused multiply-adds a line, one thread: 28–29 ms a GiB with this prefetch, 31–33 with
// the former, 27–30 without the arithmetic. Real 1.5B forwards (Zen 5 host, paired shuffled rounds, bitwise equal):
// the former took 1.00–1.15× the time at k = 1–16 in fast memory (k = 6: 1.15), 1.01–1.07× in slow, 1.01–1.17× with
// one thread. AVX2 builds keep the former, not measured against it.
// A call of 2–4 rows (one tile over four streams) fetches those 128 steps over its four streams, 32 ahead on each: its
// 8–16 multiply-adds a k-step held the hardware prefetcher back. Against leaving the streams to it (real 1.5B forwards,
// Zen 5 host, paired shuffled rounds, bitwise equal): one thread 0.96–0.99 of the time at k = 2 and 0.94–0.95 at 3–4;
// two threads in fast memory 0.99–1.01 at k = 2 and 0.95–0.98 at 3–4, in slow memory 0.99–1.01 at k = 1–4. A prefill
// chunk's first tile keeps 128 steps ahead on each of its four streams (32 each: 0.95–0.96 of the time at 32 rows,
// but 1.04–1.05× at 256–512). 5–8 rows over four (or three) streams prefetched so: 1.00–1.03× the time at 5–6 rows,
// 0.97–0.98 at 7–8 (one thread), so they keep one.
// On a Zen 4 host (32 KiB L1) the same prefetches held the stream back instead: 1–5 rows stream best left to the
// hardware prefetcher, over four panels (6 rows too: kOneTileCalls), and 7–24 rows over one stream prefetched 128
// k-steps ahead into L2 (`prefetcht1`), not L1. One thread over a 400 MB product on 2 MiB pages (where one core
// bounds the stream, as each of the two does in fast memory), against the Zen 5 choice: 2–4 rows 0.80–0.83 of the
// time, 6–8 rows 0.70–0.71, 10–12 0.78–0.84, 16 0.92; 5 rows over four panels 0.86 of one stream's time; 2–5 rows
// over one stream into L2, 1.12–1.37×. Real 1.5B forwards (paired shuffled rounds, two threads, fast memory, bitwise
// equal): 0.83 / 0.81 / 0.79 / 0.75 / 0.85 / 0.93 of the time at k = 2 / 4 / 6 / 8 / 12 / 16; one stream into L1 for
// 6–16 rows instead: 0.99–1.01.
constexpr int kPrefetchMinRows = simd::kWide ? 2 : 4;
constexpr int64_t kPrefetchSteps = simd::kWide ? 128 : 24;
constexpr int64_t kFarPrefetchSteps = simd::kWide ? 0 : 256;  // into L2; 0: none
// AVX2 (measured on a Zen 4 host running the AVX2 build, the 1.5B's 113 products, 6 paired rounds): 2 / 3 rows over
// two panels took 0.82 / 0.89 of their time over one prefetched panel; one row over two panels or four, the same.
constexpr int kOneStreamRows = simd::kWide ? 5 : 4;
constexpr int64_t kChunkSteps = 512;     // k per chunk when several row tiles share the panels (4 × 32 KiB)

// W [N, K] float → packed [ceil(N / 16)][K][16], the last panel's missing channels zero
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kFloat32 && weight.dim() == 2, "pack: float32 [N, K] weights expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kLanes - 1) / kLanes;
  auto packed = specdec::zeros_on_huge_pages({panels, k, kLanes}, torch::kFloat32);
  const float* w = weight.data_ptr<float>();
  float* p = packed.data_ptr<float>();
  at::parallel_for(0, panels, 16, [&](int64_t begin, int64_t end) {
    for (int64_t panel = begin; panel < end; ++panel)
      for (int64_t lane = 0; lane < kLanes && panel * kLanes + lane < n; ++lane)
        for (int64_t col = 0; col < k; ++col) p[(panel * k + col) * kLanes + lane] = w[(panel * kLanes + lane) * k + col];
  });
  return packed;
}

// acc [MR][NR] over k-steps [0, steps) of rows xt[s · x_stride + m] and panels panel + j · panel_stride; starts from
// zero or from the partial sums in y (row stride n); leaves the sums in y, masked to the `width` valid channels.
// Each stream prefetched kAhead k-steps ahead (0: none) into the cache level kHint, and the inputs kInputsAhead steps
// ahead into L1 (0: none). kAhead is a template argument: as a run-time flag GCC tested it at every k-step, and one row
// (four streams, one multiply-add a line) took 1.06–1.17× the time it takes without the test (one thread, the 1.5B's
// products).
template <int MR, int NR, int64_t kAhead, _mm_hint kHint, int64_t kInputsAhead = 0>
void micro_tile(const float* xt, int64_t x_stride, int64_t steps, const float* panel, int64_t panel_stride,
                bool resume, float* y, int64_t n, int64_t width) {
  simd::Vec acc[MR][NR];
  simd::Mask mask[NR];
#pragma GCC unroll 4
  for (int j = 0; j < NR; ++j) mask[j] = simd::lane_mask(width - j * kLanes);
  // every loop over rows and panels unrolled whole, so GCC keeps the accumulators in registers
#pragma GCC unroll 24
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = resume ? simd::load(mask[j], y + m * n + j * kLanes) : simd::zero();
  for (int64_t s = 0; s < steps; ++s) {
    if constexpr (kAhead > 0) {
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) {
        const float* stream = panel + j * panel_stride;
        _mm_prefetch(reinterpret_cast<const char*>(stream + (s + kAhead) * kLanes), kHint);
        if constexpr (kFarPrefetchSteps > 0)
          _mm_prefetch(reinterpret_cast<const char*>(stream + (s + kFarPrefetchSteps) * kLanes), _MM_HINT_T1);
      }
    }
    simd::Vec w[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w[j] = simd::load(panel + j * panel_stride + s * kLanes);
    const float* a = xt + s * x_stride;
    if constexpr (kInputsAhead > 0)  // past the last step: a line the prefetch may not find, harmless
      _mm_prefetch(reinterpret_cast<const char*>(a + kInputsAhead * x_stride), _MM_HINT_T0);
#pragma GCC unroll 24
    for (int m = 0; m < MR; ++m) {
      const simd::Vec x = simd::broadcast(a[m]);
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[m][j] = simd::fmadd(x, w[j], acc[m][j]);
    }
  }
#pragma GCC unroll 24
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) simd::store(y + m * n + j * kLanes, mask[j], acc[m][j]);
}

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, int64_t, bool, float*, int64_t, int64_t);

template <int NR, int64_t kAhead, _mm_hint kHint, int64_t kInputsAhead = 0, int... MR>
constexpr std::array<TileFn, sizeof...(MR)> tiles_of(std::integer_sequence<int, MR...>) {
  return {&micro_tile<MR + 1, NR, kAhead, kHint, kInputsAhead>...};
}
// How a table's tiles prefetch: not at all; kPrefetchSteps ahead on each stream (a prefill chunk's first tile); or
// kPrefetchSteps ahead in all, spread over the tile's streams (calls of one tile: one stream that far, four 32 each),
// into L1 or (Zen 4) L2
enum class Fetch { kNone, kEachStream, kSpread, kSpreadIntoL2 };
constexpr int64_t steps_ahead(Fetch fetch, int nr) {
  return fetch == Fetch::kNone ? 0 : fetch == Fetch::kEachStream ? kPrefetchSteps : kPrefetchSteps / nr;
}
constexpr _mm_hint level(Fetch fetch) { return fetch == Fetch::kSpreadIntoL2 ? _MM_HINT_T1 : _MM_HINT_T0; }
// tiles[NR − 1][MR − 1]: 1 … kMaxAccumulators rows over one panel, 1 … kMaxRowsOverTwoPanels over two (Intel: calls
// of 6–12 rows), 1 … kMaxRowsOverPanels rows over three or four (fewer than four: the last panels of a call); the
// rest unused
constexpr int kMaxRowsOverPanels = kMaxAccumulators / kFewRowPanels;
constexpr int kMaxRowsOverTwoPanels = kMaxAccumulators / 2;
using Tiles = std::array<std::array<TileFn, kMaxAccumulators>, kMaxPanels>;
template <Fetch kFetch>
Tiles tiles_fetching() {
  Tiles tiles{};
  const auto t1 = tiles_of<1, steps_ahead(kFetch, 1), level(kFetch)>(
      std::make_integer_sequence<int, kMaxAccumulators>{});
  const auto t2 = tiles_of<2, steps_ahead(kFetch, 2), level(kFetch)>(
      std::make_integer_sequence<int, kMaxRowsOverTwoPanels>{});
  const auto t3 = tiles_of<3, steps_ahead(kFetch, 3), level(kFetch)>(
      std::make_integer_sequence<int, kMaxRowsOverPanels>{});
  const auto t4 = tiles_of<4, steps_ahead(kFetch, 4), level(kFetch)>(
      std::make_integer_sequence<int, kMaxRowsOverPanels>{});
  std::copy(t1.begin(), t1.end(), tiles[0].begin());
  std::copy(t2.begin(), t2.end(), tiles[1].begin());
  std::copy(t3.begin(), t3.end(), tiles[2].begin());
  std::copy(t4.begin(), t4.end(), tiles[3].begin());
  return tiles;
}
const Tiles kTiles = tiles_fetching<Fetch::kNone>();
const Tiles kEachStreamTiles = tiles_fetching<Fetch::kEachStream>();
const Tiles kSpreadTiles = tiles_fetching<Fetch::kSpread>();
const Tiles kSpreadIntoL2Tiles = tiles_fetching<Fetch::kSpreadIntoL2>();

// On Zen 4 a call of 6 rows (one tile over four panels) also fetches its inputs 8 k-steps ahead into L1. Its input
// lines (24 bytes a step) are each read in 2–3 steps and then not before the next four panels, by when the weight
// stream has evicted them from L1: a demand miss every few steps. Over a 400 MB product (two threads, paired shuffled
// rounds, bitwise equal): 0.96–0.97 of the time in fast memory (3 runs; the inputs always hitting L1, as a bound:
// 0.91), 0.99–1.00 in slow; 4 steps ahead: 0.97–0.98; at 4 rows: 0.99–1.00. Real 1.5B forwards at k = 6 (paired
// shuffled rounds, bitwise equal): 0.959 (context 128) and 0.966 (1024) in fast memory, quartiles 0.94–0.97; 0.994
// in slow.
constexpr int64_t kSixRowInputsAhead = 8;
// `tiles` with their 6-row tiles over 1 … sizeof...(NR) panels so
template <int... NR>
Tiles with_six_row_inputs_ahead(Tiles tiles, std::integer_sequence<int, NR...>) {
  ((tiles[NR][5] = &micro_tile<6, NR + 1, 0, _MM_HINT_T0, kSixRowInputsAhead>), ...);
  return tiles;
}
// AVX2 tiles of 6 rows read one panel and are not measured so: kTiles itself
const Tiles kSixRowInputsAheadTiles =
    with_six_row_inputs_ahead(kTiles, std::make_integer_sequence<int, simd::kWide ? kMaxPanels : 0>{});

// Calls of one tile (up to 24 rows): from how many rows they read one stream (fewer: kFewRowPanels; up to
// two_panel_rows: two panels) and prefetch it (fewer: the hardware prefetcher alone, with few_row_tiles), and with
// which tiles; chosen once for the host. On Zen 4, 6 rows over four panels left to the hardware prefetcher, against one
// stream into L2 (real 1.5B forwards at k = 6, contexts 128 and 1024, two threads, paired shuffled rounds, bitwise
// equal): 0.943–0.965 of the time in slow memory (8 runs of 16 rounds), 1.00–1.01 in fast (2 runs). Over a 400 MB
// product: two threads in slow memory 0.945–0.96 (prefetched into L2 as well: 0.965–0.97), one thread 0.98–1.01. 7 rows
// and more do not fit four panels' accumulators.
// On an Intel host (AVX-512, AMX; ~34 GB/s) 1–5 rows read four panels (1 row left to the hardware prefetcher, 2–5
// prefetched into L1 spread over them), 6–12 two (prefetched into L1 spread over them), 13–24 one stream prefetched
// into L2, their inputs into L1 (kOneStreamInputsAhead). Over the 1.5B's 113 products (random weights, two threads,
// paired shuffled rounds, bitwise equal), against the Zen 5 choice: 0.84 of the time at 5 rows, 0.88 at 6, 0.91 at 8,
// 0.95 at 12, 0.98 at 16, 1.00 at 1–4; 5 rows over one stream into L2: 0.89; 6 rows as on Zen 4 (four panels, the
// inputs fetched ahead): 0.96; the Zen 4 choice whole: 1.10–1.14× at 2–4 rows. Then two panels against that one stream
// (fortieth session; 8 rounds): 0.95 at 6 rows, 0.92 at 7, 0.90 at 8 (0.90–0.94 in three runs), 0.84 at 12 (0.82–0.85
// in three). A 12-row tile's 24 accumulators take a broadcast input for two multiply-adds, where one stream's 16-row
// tile loads an input for each (load ports, not the multiply-adds, bound it). 16 rows over two panels, as two tiles of
// 8 sharing chunks of 256–512 k-steps: 1.04–1.09× (the second tile prefetching the next chunk into L2: 1.00); tiles of
// 6 rows over four panels from 8 rows: 1.15–1.28×.
struct OneTileCalls {
  int one_stream_rows, prefetch_min_rows;
  int two_panel_rows;  // calls of one_stream_rows … two_panel_rows rows read two panels instead (none: 0)
  const Tiles& tiles;
  const Tiles& few_row_tiles;
};
// On an Intel host the one-stream tiles (13–24 rows) also fetch their inputs 16 k-steps ahead into L1. A k-step's
// inputs are a line of their own (64 bytes at 16 rows), read again for every panel: 96 KiB at K = 1536, more than
// L1 holds beside the weight stream, so each step's broadcasts waited on an L1 miss. Over a 448 MiB product (two
// threads, paired shuffled rounds, bitwise equal; a copy of the installed source as control: 0.97–1.03): 0.92–0.94
// of the time at 16 rows (K = 1536 and 8960), 0.96–0.99 at 13, 0.95–0.98 at 20; 4 and 8 steps ahead: 0.94–0.95 at
// 16. Real 1.5B forwards (one model a process, four processes each, alternating; logits bitwise equal): 0.92–0.94 of
// the time at k = 13 and 16, contexts 128 and 1024. The two-panel tiles (6–12 rows, an input line per two panels)
// fetched so: 0.98–1.04, within the control's spread; the weights fetched 8–32 steps ahead into L1 as well as 192–256
// into L2: 0.96–0.98 at 16 rows, against a control's 0.93; K cut into chunks of 128–512 steps that a group of 4–16
// panels share, so that the inputs stay in L1: 1.00–1.06×. (A call of 1–12 rows whose last group is one panel runs
// it on these tiles too: one panel a call, not measured apart.)
constexpr int64_t kOneStreamInputsAhead = 16;
// kSpreadTiles, but one panel's tiles (one stream) prefetching into L2 and fetching their inputs ahead
Tiles intel_tiles(Tiles tiles) {
  const auto one_stream = tiles_of<1, kPrefetchSteps, _MM_HINT_T1, kOneStreamInputsAhead>(
      std::make_integer_sequence<int, kMaxAccumulators>{});
  std::copy(one_stream.begin(), one_stream.end(), tiles[0].begin());
  return tiles;
}
const Tiles kIntelTiles = intel_tiles(kSpreadTiles);
const OneTileCalls kOneTileCalls = [] {
  if (simd::kWide && specdec::host() == specdec::Host::kZen4)
    return OneTileCalls{7, 7, 0, kSpreadIntoL2Tiles, kSixRowInputsAheadTiles};
  if (simd::kWide && specdec::host() == specdec::Host::kIntel) return OneTileCalls{6, 2, 12, kIntelTiles, kTiles};
  return OneTileCalls{kOneStreamRows, kPrefetchMinRows, 0, kSpreadTiles, kTiles};
}();

// x [M, K] → [K, M], each k-step's inputs side by side, as a call of one tile reads them. PyTorch's transposed copy
// (x.t().contiguous(), single-threaded while the other thread waits) took 15 / 73 µs for 6 rows of 1536 / 8960 inputs
// in cache, 43 / 121 µs cold: ~3.6 ms of a float32 1.5B forward at k = 6 (torch profiler, Zen 4 host). Masked permutes
// (AVX-512, up to 16 rows) took 3.0 / 12.5 µs in cache, 12 / 41 cold; the scalar loop 6 / 33 and 15 / 47. Real
// 1.5B forwards (paired shuffled rounds, bitwise equal) took 0.95–0.99 of the former time at k = 2–12.
torch::Tensor k_major(const torch::Tensor& x) {
  const int64_t m = x.size(0), k = x.size(1);
  if (k > 1 && x.stride(1) != 1) return k_major(x.contiguous());
  if (m == 1) return x;
  auto xt = torch::empty({k, m}, x.options());
  const float* in = x.data_ptr<float>();
  const int64_t row_stride = x.stride(0);
  float* out = xt.data_ptr<float>();
  int64_t s = 0;
#if defined(__AVX512F__)
  if (m <= kLanes) {
    // 16 k-steps at a time: the M rows' vectors in, M vectors out, whose lane i is element p = 16 v + i of the
    // [16][M] block: input p / M of row p % M, one masked permute per row
    __m512i index[kLanes];
    __mmask16 from_row[kLanes][kLanes] = {};
    for (int v = 0; v < m; ++v) {
      alignas(64) int32_t lanes[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const int p = kLanes * v + i;
        lanes[i] = p / m;
        from_row[v][p % m] |= static_cast<__mmask16>(1u << i);
      }
      index[v] = _mm512_load_si512(lanes);
    }
    for (; s + kLanes <= k; s += kLanes) {
      __m512 rows[kLanes];
      for (int r = 0; r < m; ++r) rows[r] = _mm512_loadu_ps(in + r * row_stride + s);
      for (int v = 0; v < m; ++v) {
        __m512 block = _mm512_setzero_ps();
        for (int r = 0; r < m; ++r) block = _mm512_mask_permutexvar_ps(block, from_row[v][r], index[v], rows[r]);
        _mm512_storeu_ps(out + s * m + v * kLanes, block);
      }
    }
  }
#endif
  for (int64_t s0 = s; s0 < k; s0 += 64)  // in blocks whose outputs stay in L1
    for (int64_t r = 0; r < m; ++r)
      for (int64_t i = s0; i < std::min(k, s0 + 64); ++i) out[i * m + r] = in[r * row_stride + i];
  return xt;
}

// x [M, K] float32 → y [M, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "fp32 linear: float32 [M, K] input expected");
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0);
  TORCH_CHECK(k > 0 && packed.size(1) == k, "fp32 linear: input has ", k, " features, the weights ", packed.size(1));
  TORCH_CHECK(panels == (n + kLanes - 1) / kLanes, "fp32 linear: ", n, " outputs do not fit ", panels, " panels");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const int nr = m < kOneTileCalls.one_stream_rows  ? kFewRowPanels
                 : m <= kOneTileCalls.two_panel_rows ? 2
                 : m <= kMaxAccumulators             ? 1
                                                     : kWidePanels;
  const int64_t max_rows = kMaxAccumulators / nr, row_tiles = (m + max_rows - 1) / max_rows;
  // k-major inputs, a k-step's inputs of a tile side by side: [K, M] for one tile, else [tiles][K][max_rows] (the
  // last tile padded with zero rows)
  const int64_t x_stride = row_tiles == 1 ? m : max_rows;
  const auto xt = row_tiles == 1 ? k_major(x)
                                 : at::constant_pad_nd(x, {0, 0, 0, row_tiles * max_rows - m})
                                       .view({row_tiles, max_rows, k}).transpose(1, 2).contiguous();
  const float* a = xt.data_ptr<float>();
  const float* p = packed.data_ptr<float>();
  float* out = y.data_ptr<float>();
  const int64_t chunk = row_tiles == 1 ? k : kChunkSteps, groups = (panels + nr - 1) / nr;
  // the first (or only) tile of each chunk prefetches the panels' streams; the others read them from cache
  const Tiles& first_tiles = row_tiles > 1                            ? kEachStreamTiles
                             : m < kOneTileCalls.prefetch_min_rows ? kOneTileCalls.few_row_tiles
                                                                   : kOneTileCalls.tiles;
  specdec::parallel_shares(groups, [&](specdec::ShareCursor& cursor) {
    int64_t g;
    while (cursor.next(g)) {
      const int panels_here = static_cast<int>(std::min<int64_t>(nr, panels - g * nr));
      const int64_t col = g * nr * kLanes, width = std::min<int64_t>(panels_here * kLanes, n - col);
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        const int64_t steps = std::min(chunk, k - k0);
        for (int64_t t = 0; t < row_tiles; ++t) {
          const int64_t m0 = t * max_rows, mr = std::min(max_rows, m - m0);
          const Tiles& tiles = t == 0 ? first_tiles : kTiles;
          tiles[panels_here - 1][mr - 1](a + t * k * x_stride + k0 * x_stride, x_stride, steps,
                                         p + (g * nr * k + k0) * kLanes, k * kLanes, k0 > 0, out + m0 * n + col, n, width);
        }
      }
      if (bias.has_value()) {
        const float* b = bias->data_ptr<float>() + col;
        for (int64_t r = 0; r < m; ++r)
          for (int64_t c = 0; c < width; c += kLanes) {
            const simd::Mask mask = simd::lane_mask(width - c);
            float* dst = out + r * n + col + c;
            simd::store(dst, mask, simd::add(simd::load(mask, dst), simd::load(mask, b + c)));
          }
      }
    }
  });
  return y;
}

// the layer loop's entry (kernel_entry.h): operands {packed} or {packed, bias}
torch::Tensor linear_entry(const torch::Tensor& x, const std::vector<torch::Tensor>& operands, int64_t n) {
  TORCH_CHECK(operands.size() == 1 || operands.size() == 2, "fp32 linear: operands {packed[, bias]} expected");
  return linear(x, operands[0], operands.size() == 2 ? c10::optional<torch::Tensor>(operands[1]) : c10::nullopt, n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack", &pack);
  module.def("linear", &linear);
  module.attr("linear_entry") = specdec::entry::capsule<specdec::entry::Linear>(&linear_entry);
}
