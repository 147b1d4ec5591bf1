// int8 x int8 linear for few rows (decode and verification), AVX-512 VNNI.
//
// y[m, n] = (Σ_k xq[m, k] · W[n, k]) · s_w[n] · s_x[m] + b[n], with xq = round(x / s_x) per row (s_x = max|x| / 127)
// and exact int32 sums: a row's result never depends on the other rows (batch invariance).
// Weights are packed once into panels of 64 output channels, k-step-major: [N / 64][K / 4][64][4] (four zmm of
// vpdpbusd per k-step, read as one sequential stream), on 2 MiB pages (huge_pages.h), shifted to u8 (+128), vpdpbusd's
// unsigned operand; the activations stay s8, its signed one, and 128 · Σ_k xq[m, k] is subtracted back. So the
// activations can be vpdpbusd's broadcast memory operand ({1to16}): a tile then holds no broadcast register and loads
// each row's 4 bytes in the instruction. Passes of up to 8 rows, bound by the weight stream, take it (how and why:
// kMemoryBroadcastMaxRows); more rows, bound by the arithmetic, broadcast each row's 4 bytes into a register once per
// k-step.
// Up to 6 rows form one tile of ≤ 24 accumulators (≤ 6 rows × 64 channels) that streams each panel once. More rows
// take near-equal tiles of ≤ 6 rows that share each panel in chunks of 64 k-steps (16 KiB, held in L1): the first
// tile streams a chunk from memory, the others read it from L1, their int32 sums waiting in a buffer between chunks
// (exact: integer sums in any order are the same), and the tiles share out the prefetch of the next chunk, so the
// stream overlaps the arithmetic of all tiles (how: kChunksPrefetchIntoL1). Against tiles that each passed over a
// whole panel held in L2 (and one tile of ≤ 12 rows × 32 channels in two passes for 7–12 rows): 0.86–0.90 of the time
// at 7–12 rows, 0.72–0.90 at 13–24, 0.94 at 64 (Zen 5 host, the 1.5B's products, shuffled A/B, bitwise equal).
// Chunks of 32 k-steps took 0.90–0.92 at 7–16 rows, 96: 0.85–0.92, 128: 0.96–0.99 at 8–12 rows; 64: 0.86–0.88.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <immintrin.h>
#include <array>
#include <cstring>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "cpu_family.h"
#include "huge_pages.h"
#include "kernel_entry.h"
#include "row_quantize.h"
#include "shared_work.h"
#include "simd.h"

namespace {

constexpr int64_t kLanes = 16;     // output channels per zmm
constexpr int64_t kPanelZmm = 4;   // zmm of channels per packed panel: 64 channels
constexpr int64_t kBlock = kLanes * kPanelZmm;
constexpr int64_t kStepBytes = kBlock * 4;  // one k-step (4 inputs) of a panel
constexpr int kMaxAccumulators = 24;        // + the weights and a broadcast: within the 32 zmm
constexpr int kTileRows = kMaxAccumulators / kPanelZmm;
constexpr int64_t kChunkSteps = 64;         // k-steps of a panel that several tiles share from L1
// Calls of up to this many rows take the activations as vpdpbusd's broadcast memory operand. Against a broadcast into
// a register (the 1.5B's 113 products, random weights, one thread, where one core bounds the stream as each of the two
// does in fast memory; paired shuffled rounds, bitwise equal; Zen 5 host): 0.98–0.99 of the time at one row,
// 1.00 at 3–4 rows, 0.95–0.99 at 6 and 0.95–0.96 at 8; but 1.12–1.14× at 12 rows and 1.15–1.20× at 16, where the
// arithmetic bounds the pass and the loads in every instruction slow it (from L1 alone, 6 rows over 1 GiB: 16.3 ms
// against 12). This kernel against the one before it (u8 activations broadcast into registers; the same products,
// paired, bitwise equal): two threads in fast memory 0.95–0.98 of the time at 3–12 rows and 1.00 at 1–2, in slow
// memory 0.96–1.03; one thread 0.98–0.99 at 2–8 rows, 0.99–1.01 at 9–16.
constexpr int64_t kMemoryBroadcastMaxRows = 8;
// one-tile calls always take the memory operand, calls of three tiles or more never (their tables hold only that)
static_assert(kTileRows <= kMemoryBroadcastMaxRows && kMemoryBroadcastMaxRows <= 2 * kTileRows);
// Ahead of the panel stream, into L1 (6 KiB). In the real 1.5B's forwards on a Zen 5 host (every product's kernel
// swapped, paired shuffled rounds, 14–24 rounds a run), 24 steps instead of 8 took 0.81–0.90 of the time at 4–6 rows
// in two runs (16: 0.85–0.98 in three, 32: 0.80–0.88 in two, 48: 0.84–0.91 in one) and 0.99–1.00 at 8–12 rows,
// whose chunks are in L2 already.
constexpr int64_t kPrefetchSteps = 24;
// Decode and verification calls of up to hardware_prefetch_max_rows() rows leave their stream to the hardware
// prefetcher. On a Zen 4 host, on 2 MiB pages, that took 0.76–0.92 (2 rows) and 0.85–0.95 (3 rows) of the time with
// the near and far prefetches (the 1.5B's products, interleaved A/B in shuffled order, fast memory), one row 0.90 of
// the time over the 1.5B's products (slow memory), 0.82–0.84 over 256 MiB products (fast memory, where it then reads
// about as fast as a sum), and 4 rows 0.92–0.96 of the real 1.5B's forward time (paired shuffled rounds; 0.91–0.93
// over its products alone), but 5–6 rows 1.00–1.08. On a Zen 5 host 4 rows run 0.87–0.91 of the time with the near
// prefetch (the real 1.5B's forwards, shuffled A/B; 0.89 over its products alone), 5 rows 0.96–1.01 and 1–3 rows
// 0.96–1.05 in forwards of two threads. One thread alone in slow memory (where one core bounds the stream, as each of
// the two does in fast memory; the 1.5B's 113 products, paired shuffled rounds): 3 rows with the near prefetch took
// 0.94–0.97 of the time, 2 rows 1.04–1.07×; two threads in slow memory, 3 rows 0.99 (quartiles 0.97–1.02) of the real
// 1.5B's forward time. So on Zen 5 3 rows and more keep it; on hosts not measured, 4 and more.
const specdec::Host kHost = specdec::host();
const int kHardwarePrefetchMaxRows = [] {
  switch (kHost) {
    case specdec::Host::kZen4: return 4;
    case specdec::Host::kZen5: return 2;
    default: return 3;
  }
}();

// How tiles that share chunks prefetch the next chunk. Over the 1.5B's 113 products (random weights, Zen 5 host, 48 KiB
// L1, paired shuffled rounds binned by the memory's speed), the pass at 7–12 rows (two tiles) is bound by its memory
// stream more than by its arithmetic: with the arithmetic taken out it still took 28–30 ms in fast memory, against 23
// for 6 rows (one tile) and 20–21 for one row, and 21.9 with the second tile also skipped: the memory idles while the
// second tile reads the chunk from L1. Two tiles that each fetch their half of the next chunk into L1 in memory order
// took 0.89–0.91 of the time at 8–12 rows in fast memory and 0.93–0.97 in slow (into L2: 0.91–0.93 at 8 rows); with
// three tiles that took 1.00–1.09 at 16 rows, but the first tile prefetching its own chunk as one-tile passes do, the
// others sharing the next chunk's lines into L2, took 0.91–0.94. In the real 1.5B's forwards (paired shuffled rounds,
// bitwise equal) the two together took 0.92–0.97 of the time at k = 7–16 in fast memory and 0.95–1.00 in slow. More
// tiles (prefill, 19 rows and up) keep the L2 prefetch alone. Where L1 holds less than 48 KiB (Zen 4: 32 KiB, two
// chunks and nothing else) the first tile's own prefetch took 1.25–1.33× the time at 7–8 rows, and fetching a chunk
// into L1 beside the one read is not measured: there every tile shares the next chunk's lines into L2.
const bool kChunksPrefetchIntoL1 = sysconf(_SC_LEVEL1_DCACHE_SIZE) >= (48 << 10);
constexpr int kChunkLines = static_cast<int>(kChunkSteps * kStepBytes / 64);

// W [N, K] int8 → packed [Np / 64][Kp / 4][64][4] of W + 128 as u8 (held in an int8 tensor), Np and Kp padded with
// zero weights (128)
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2, "pack: int8 [N, K] weights expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t np = (n + kBlock - 1) / kBlock * kBlock, kp = (k + 3) / 4 * 4;
  auto packed = specdec::zeros_on_huge_pages({np / kBlock, kp / 4, kBlock, 4}, torch::kInt8);
  packed.fill_(static_cast<int8_t>(INT8_MIN));  // the bits of u8 128: a zero weight
  const int8_t* w = weight.data_ptr<int8_t>();
  uint8_t* p = reinterpret_cast<uint8_t*>(packed.data_ptr<int8_t>());
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t block = row / kBlock, lane = row % kBlock;
      for (int64_t col = 0; col < k; ++col)
        p[((block * (kp / 4) + col / 4) * kBlock + lane) * 4 + col % 4] = static_cast<uint8_t>(w[row * k + col] + 128);
    }
  });
  return packed;
}

// one row of x [K] float → s8 at out + (c / 4) · step_stride + c % 4 (zeros from K to Kp), its scale and the sum of
// its s8 values
void quantize_row_strided(const float* row, int64_t k, int64_t kp, int64_t step_stride, int8_t* out, float* scale,
                          int32_t* sum) {
  const float s = specdec::row_scale(row, k);
  *scale = s;
  __m512i sums = _mm512_setzero_si512();
  int32_t tail = 0;
  specdec::quantize_row(
      row, k, s,
      [&](int64_t c, __m512i q) {
        sums = _mm512_add_epi32(sums, q);
        alignas(16) uint32_t groups[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(groups), _mm512_cvtepi32_epi8(q));
        if (step_stride == 4) {
          std::memcpy(out + c, groups, 16);
        } else {
          for (int g = 0; g < 4; ++g) std::memcpy(out + (c / 4 + g) * step_stride, groups + g, 4);
        }
      },
      [&](int64_t c, int32_t q) {
        out[(c / 4) * step_stride + c % 4] = static_cast<int8_t>(q);
        tail += q;
      });
  for (int64_t c = k; c < kp; ++c) out[(c / 4) * step_stride + c % 4] = 0;
  *sum = _mm512_reduce_add_epi32(sums) + tail;
}

// rows of x [M, K] → xq with element (r, c) at r · row_stride + (c / 4) · step_stride + c % 4: k-step-major
// (row_stride 4, step_stride 4M) when one tile takes all rows, so a k-step's broadcasts share a cache line, else
// row-major (row_stride Kp, step_stride 4), so a tile's rows stay in few lines
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t kp, int64_t row_stride, int64_t step_stride,
                   int8_t* xq, float* scale, int32_t* sum) {
  // split between the threads from 32k inputs (the other thread would only wait): a call of 16 rows of 8960 inputs
  // and one panel took 45 µs quantizing on one thread, 33 µs on two (Intel host)
  at::parallel_for(0, m, std::max<int64_t>(1, (32 << 10) / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row_strided(x + r * k, k, kp, step_stride, xq + r * row_stride, scale + r, sum + r);
  });
}

// What a tile prefetches at each k-step s: its own step s + kPrefetchSteps (own: read by one-tile calls of more than
// kHardwarePrefetchMaxRows rows, and by the first of three tiles sharing chunks), and its share of what
// comes next (null: nothing): lines [next_first, next_end) of step s into L2, or (kSequentialNext) of the next chunk's
// lines, numbered in memory order, those in [next_first, next_end) into L1, in order, spread over the tile's steps.
struct Prefetch {
  const char* own;
  const char* next;
  int next_first, next_end;
};

// Where a tile fetches its own stream: not at all, or kPrefetchSteps ahead into L1
enum class Own { kNone, kIntoL1 };

// acc [MR][64] = Σ over `steps` k-steps of rows m0 … m0 + MR − 1 times a panel's 64 channels, added to the sums
// already in acc (kResume) or from zero; kMemoryBroadcast: each row's 4 bytes a k-step as vpdpbusd's broadcast memory
// operand (GCC does not fold the broadcast into the instruction itself), else broadcast into a register;
// kWeightsAhead: the weights of k-step s + kWeightsAhead are loaded into registers as step s multiplies (see
// kFourRowWeightsAhead), 0: each step's as it multiplies; kActivationsAhead: step s fetches the activations of step
// s + kActivationsAhead into L1 (see kSixRowActivationsAhead), 0: none
template <int MR, bool kStepMajor, bool kResume, Own kOwn, bool kSequentialNext, bool kMemoryBroadcast,
          int kWeightsAhead = 0, int kActivationsAhead = 0>
void micro_tile(const int8_t* xq, int64_t row_stride, int64_t step_stride, int64_t steps, const int8_t* panel,
                Prefetch prefetch, int32_t* acc_out) {
  constexpr int kSlots = kWeightsAhead + 1;  // k-steps of weights held in registers
  static_assert(MR * kPanelZmm + kSlots * kPanelZmm + (kMemoryBroadcast ? 0 : 1) <= 32, "more zmm than there are");
  static_assert(kWeightsAhead == 0 || (kOwn == Own::kNone && !kSequentialNext), "measured for one-tile calls alone");
  static_assert(kActivationsAhead == 0 || (kStepMajor && kOwn == Own::kNone && kWeightsAhead == 0),
                "measured for one-tile calls alone");
  // every loop over rows and channels unrolled whole: GCC keeps the accumulators in registers only then (without
  // the pragmas, 24 of them spill and the tile runs at half speed)
  __m512i acc[MR][kPanelZmm];
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kPanelZmm; ++j)
      acc[m][j] = kResume ? _mm512_load_si512(acc_out + (m * kPanelZmm + j) * kLanes) : _mm512_setzero_si512();
  // kSequentialNext: step s fetches the next chunk's lines [first + s · span / steps, first + (s + 1) · span / steps),
  // counted with a carry instead of two divisions a step
  const int64_t next_span = prefetch.next_end - prefetch.next_first;
  int64_t next_line = prefetch.next_first, next_carry = 0;
  // w[slot]: step s's weights in slot s % kSlots; the loop takes whole groups of kSlots steps, so every index is a
  // constant and the weights stay in registers (a test for the last step inside it spilled them)
  const int64_t grouped_steps = steps - steps % kSlots;
  __m512i w[kSlots][kPanelZmm];
  if (grouped_steps > 0)
#pragma GCC unroll 8
    for (int slot = 0; slot < kWeightsAhead; ++slot)
#pragma GCC unroll 4
      for (int j = 0; j < kPanelZmm; ++j) w[slot][j] = _mm512_loadu_si512(panel + slot * kStepBytes + j * 64);
  for (int64_t s0 = 0; s0 < grouped_steps; s0 += kSlots) {
#pragma GCC unroll 8
    for (int slot = 0; slot < kSlots; ++slot) {
      const int64_t s = s0 + slot;
      if constexpr (kOwn == Own::kIntoL1) {
#pragma GCC unroll 4
        for (int j = 0; j < kPanelZmm; ++j) _mm_prefetch(prefetch.own + s * kStepBytes + j * 64, _MM_HINT_T0);
      }
      if constexpr (kSequentialNext) {
        for (next_carry += next_span; next_carry >= steps; next_carry -= steps)
          _mm_prefetch(prefetch.next + next_line++ * 64, _MM_HINT_T0);
      } else {
        for (int j = prefetch.next_first; j < prefetch.next_end; ++j)
          _mm_prefetch(prefetch.next + s * kStepBytes + j * 64, _MM_HINT_T1);
      }
      // past the last step, the last again (unused)
      const int64_t load_step = kWeightsAhead > 0 ? std::min<int64_t>(s + kWeightsAhead, steps - 1) : s;
#pragma GCC unroll 4
      for (int j = 0; j < kPanelZmm; ++j)
        w[(slot + kWeightsAhead) % kSlots][j] = _mm512_loadu_si512(panel + load_step * kStepBytes + j * 64);
      const int8_t* a_step = xq + s * step_stride;
      if constexpr (kActivationsAhead > 0)  // past the last step: a line the prefetch may not find, harmless
        _mm_prefetch(reinterpret_cast<const char*>(a_step + kActivationsAhead * step_stride), _MM_HINT_T0);
#pragma GCC unroll 32
      for (int m = 0; m < MR; ++m) {
        const auto* a = reinterpret_cast<const int32_t*>(a_step + m * (kStepMajor ? 4 : row_stride));
        if constexpr (kMemoryBroadcast) {
#pragma GCC unroll 4
          for (int j = 0; j < kPanelZmm; ++j)
            asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc[m][j]) : "v"(w[slot][j]), "m"(*a));
        } else {
          const __m512i broadcast = _mm512_set1_epi32(*a);
#pragma GCC unroll 4
          for (int j = 0; j < kPanelZmm; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], w[slot][j], broadcast);
        }
      }
    }
  }
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < kPanelZmm; ++j) _mm512_store_si512(acc_out + (m * kPanelZmm + j) * kLanes, acc[m][j]);
  if constexpr (kWeightsAhead > 0) {
    if (grouped_steps < steps) {  // the last steps % kSlots steps, from the sums just stored
      const Prefetch rest{nullptr, prefetch.next ? prefetch.next + grouped_steps * kStepBytes : nullptr,
                          prefetch.next_first, prefetch.next_end};
      micro_tile<MR, kStepMajor, true, kOwn, kSequentialNext, kMemoryBroadcast>(
          xq + grouped_steps * step_stride, row_stride, step_stride, steps - grouped_steps,
          panel + grouped_steps * kStepBytes, rest, acc_out);
    }
  }
}

using TileFn = void (*)(const int8_t*, int64_t, int64_t, int64_t, const int8_t*, Prefetch, int32_t*);

using ChunkTiles = std::array<std::array<TileFn, kTileRows>, 2>;  // [resumed][rows − 1]

template <bool kStepMajor, bool kResume, Own kOwn, bool kSequentialNext, bool kMemoryBroadcast, int... MR>
constexpr std::array<TileFn, sizeof...(MR)> tiles_of(std::integer_sequence<int, MR...>) {
  return {&micro_tile<MR + 1, kStepMajor, kResume, kOwn, kSequentialNext, kMemoryBroadcast>...};
}
template <Own kOwn, bool kSequentialNext, bool kMemoryBroadcast>
constexpr ChunkTiles chunk_tiles_of() {
  constexpr auto rows = std::make_integer_sequence<int, kTileRows>{};
  return {tiles_of<false, false, kOwn, kSequentialNext, kMemoryBroadcast>(rows),
          tiles_of<false, true, kOwn, kSequentialNext, kMemoryBroadcast>(rows)};
}
// tiles of 1 … 6 rows: all rows in one tile, k-step-major, its stream left to the hardware or prefetched by the tile,
// the activations as the memory operand (6 ≤ kMemoryBroadcastMaxRows); several tiles, row-major, over a chunk's first
// k-step or resuming their sums, indexed by whether the activations are the memory operand
constexpr auto kOneTileRows = std::make_integer_sequence<int, kTileRows>{};
const auto kOneTile = tiles_of<true, false, Own::kNone, false, true>(kOneTileRows);
const auto kOneTileOwnPrefetch = tiles_of<true, false, Own::kIntoL1, false, true>(kOneTileRows);
const std::array<ChunkTiles, 2> kChunkTiles = {chunk_tiles_of<Own::kNone, false, false>(),
                                               chunk_tiles_of<Own::kNone, false, true>()};
const ChunkTiles kChunkTilesOwnPrefetch = chunk_tiles_of<Own::kIntoL1, false, false>();  // 13 rows and more
const std::array<ChunkTiles, 2> kChunkTilesSequentialNext = {chunk_tiles_of<Own::kNone, true, false>(),
                                                             chunk_tiles_of<Own::kNone, true, true>()};
// On Zen 4 a one-tile call of 4 rows (its stream left to the hardware prefetcher) loads each k-step's weights 3 steps
// before it multiplies them (the most its 16 free zmm hold). Over a 400 MB product (one thread, where one core bounds
// the stream as each of the two does in fast memory; paired shuffled rounds, bitwise equal): 0.94–0.95 of the time in
// 10 of 11 runs (0.99 in one); 1 or 2 steps ahead: 1.00–1.04 (0.93 in a run where each variant had its own pages).
// In the real 1.5B's forwards at k = 4, context 128 and 1024 (two threads, paired shuffled rounds, bitwise equal):
// 0.94–0.97 (quartiles 0.92–0.99) in five runs in fast memory, 0.99–1.03 in slow; k = 1, 3, 6, 8: 0.99–1.00 (Zen 4
// host). At 1–3 rows (4–6 steps ahead) or 5–6 rows (1–2 steps) the same took 0.98–1.03, and in the tiles of 7–12 rows
// that share chunks 0.99–1.01. Loading one line of a step ahead into a dead register instead (a demand load, no
// arithmetic on it), 8–32 steps ahead: 1.12–1.73×.
constexpr int kFourRowWeightsAhead = 3;

// On Zen 4 a one-tile call of 6 rows leaves its weight stream to the hardware prefetcher and fetches its activations
// 8 k-steps ahead into L1. Its activation lines (24 bytes a step, 9 KiB at K = 1536) are each read in 2–3 steps and
// then not before the next panel, by when the weight stream has evicted them from L1: a demand miss every few steps.
// A synthetic stand-in whose activations always hit L1 read 16% faster in fast memory. Over an 805 MB product (two
// threads, paired shuffled rounds, bitwise equal), against the former prefetch of its own stream into L2: 0.95–0.99
// of the time in fast memory (9 runs), 0.93–0.99 in slow; the activations fetched on top of that prefetch: 0.98–1.01;
// neither: 1.19–1.21× in fast memory; 4 steps ahead: 0.95–1.01; at 1–5 rows: 0.99–1.09; 1–2 of the lines touched a
// step round robin, to keep them in L1: 1.00–1.10. Real 1.5B forwards at k = 6 (paired shuffled rounds, bitwise
// equal): 0.954 (context 128, 3 fast rounds) and 0.984 (1024, 19 fast rounds; quartiles 0.98–0.99), 0.975–0.987 in
// slow memory.
constexpr int kSixRowActivationsAhead = 8;

// The call of each row count that one tile takes (1 … kTileRows), chosen once for the host: its stream left to the
// hardware up to kHardwarePrefetchMaxRows rows, else fetched by the tile into L1; on Zen 4, 4 and 6 rows as above
const std::array<TileFn, kTileRows> kOneTileCalls = [] {
  std::array<TileFn, kTileRows> calls{};
  for (int m = 1; m <= kTileRows; ++m)
    calls[m - 1] = (m <= kHardwarePrefetchMaxRows ? kOneTile : kOneTileOwnPrefetch)[m - 1];
  if (kHost == specdec::Host::kZen4) {
    calls[3] = &micro_tile<4, true, false, Own::kNone, false, true, kFourRowWeightsAhead>;
    calls[5] = &micro_tile<6, true, false, Own::kNone, false, true, 0, kSixRowActivationsAhead>;
  }
  return calls;
}();

// A panel's per-channel operands of store_rows (weight scales, bias; when measured, column sums too) are read once a
// forward, so they come from memory: their lines, fetched as the panel starts, arrive while it streams. Without it
// store_rows took 3% of the samples of a real 1.5B int8 forward at k = 1 and 5–6% at k = 6–12 (perf, cpu-clock), with
// it 1% at k = 6; the forwards took 0.96–1.00 of the time at k = 6–16 and 0.96–1.01 at k = 1–4 (Zen 5 host, paired
// shuffled rounds, fast and slow memory, bitwise equal). Fetching the output rows' lines for writing as well: no
// better.
void prefetch_epilogue(const float* weight_scale, const float* bias, int64_t col0, int64_t cols) {
  for (int64_t c = 0; c < cols; c += kLanes) {
    _mm_prefetch(reinterpret_cast<const char*>(weight_scale + col0 + c), _MM_HINT_T0);
    if (bias) _mm_prefetch(reinterpret_cast<const char*>(bias + col0 + c), _MM_HINT_T0);
  }
}

// What a call writes from each panel's sums: its channels (kLinear), or, for a gate/up product packed for SwiGLU (each
// panel 32 gate channels, then the same 32 channels' up), silu(gate) · up (kSwiglu): bitwise the linear's outputs
// through norm_swiglu.cpp's SwiGLU, but the gate and up halves are never written and read back.
enum class Epilogue { kLinear, kSwiglu };

// y rows m0 … m0 + rows − 1 from their int32 sums acc [rows][64] (of the u8 weights: less 128 · the row's sum) of
// channels col0 … col0 + cols − 1: those channels of y [.., n] (kLinear), or its columns col0 / 2 … col0 / 2 + 31
// (kSwiglu, a whole panel)
void store_rows(const int32_t* acc, int rows, int64_t m0, int64_t col0, int64_t cols, const int32_t* row_sum,
                const float* weight_scale, const float* row_scale, const float* bias, float* out, int64_t n,
                Epilogue epilogue) {
  for (int r = 0; r < rows; ++r) {
    const __m512 rs = _mm512_set1_ps(row_scale[m0 + r]);
    const __m512i shift = _mm512_set1_epi32(row_sum[m0 + r] * 128);
    const auto channels = [&](int64_t c, __mmask16 mask) {
      const int64_t col = col0 + c;
      const __m512i sums = _mm512_sub_epi32(_mm512_load_si512(acc + r * kBlock + c), shift);
      __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_maskz_loadu_ps(mask, weight_scale + col)), rs);
      if (bias) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + col));
      return v;
    };
    if (epilogue == Epilogue::kSwiglu) {
      float* dst = out + (m0 + r) * n + col0 / 2;
      for (int64_t c = 0; c < kBlock / 2; c += kLanes)
        _mm512_storeu_ps(dst + c, specdec::simd::swiglu(channels(c, 0xFFFF), channels(c + kBlock / 2, 0xFFFF)));
      continue;
    }
    float* dst = out + (m0 + r) * n + col0;
    for (int64_t c = 0; c < cols; c += kLanes) {
      const __mmask16 mask = cols - c >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (cols - c)) - 1);
      _mm512_mask_storeu_ps(dst + c, mask, channels(c, mask));
    }
  }
}

// the product's channels behind a call's n outputs, checked against the packed panels
int64_t product_channels(const torch::Tensor& packed, int64_t n, Epilogue epilogue) {
  const int64_t channels = epilogue == Epilogue::kSwiglu ? 2 * n : n;
  TORCH_CHECK(channels > (packed.size(0) - 1) * kBlock && channels <= packed.size(0) * kBlock,
              "int8 linear: ", n, " outputs from ", packed.size(0), " panels");
  TORCH_CHECK(epilogue == Epilogue::kLinear || channels % kBlock == 0,
              "int8 linear: SwiGLU takes whole panels of gate and up channels");
  return channels;
}

// x, contiguous, once it is float32 [M, K] with K the packed weights' in-features
torch::Tensor checked_input(const torch::Tensor& x, const torch::Tensor& packed) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int8 linear: float32 [M, K] input expected");
  const int64_t k = x.size(1);
  TORCH_CHECK(packed.size(1) * 4 == (k + 3) / 4 * 4, "int8 linear: input has ", k, " features");
  return x.contiguous();
}

// x [M, K] float32 → y [M, n] float32: the product's n channels, or for SwiGLU its 2n channels' n outputs
torch::Tensor linear_with(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scale,
                          c10::optional<torch::Tensor> bias, int64_t n, Epilogue epilogue) {
  x = checked_input(x, packed);
  const int64_t channels = product_channels(packed, n, epilogue);
  const int64_t m = x.size(0), k = x.size(1), steps = packed.size(1), kp = steps * 4, blocks = packed.size(0);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const int64_t row_tiles = (m + kTileRows - 1) / kTileRows;
  std::unique_ptr<int8_t[]> xq(new int8_t[m * kp]);  // not zeroed: quantize_rows writes every byte
  std::vector<float> row_scale(m);
  std::vector<int32_t> row_sum(m);
  const int64_t row_stride = row_tiles == 1 ? 4 : kp, step_stride = row_tiles == 1 ? m * 4 : 4;
  quantize_rows(x.data_ptr<float>(), m, k, kp, row_stride, step_stride, xq.get(), row_scale.data(), row_sum.data());
  std::vector<int64_t> tile_first(row_tiles + 1, 0);  // near-equal tiles: tile t holds rows [first[t], first[t + 1])
  for (int64_t t = 0; t < row_tiles; ++t)
    tile_first[t + 1] = tile_first[t] + (m - tile_first[t] + row_tiles - t - 1) / (row_tiles - t);
  const int8_t* p = packed.data_ptr<int8_t>();
  const float* ws = weight_scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  const TileFn one_tile = row_tiles == 1 ? kOneTileCalls[m - 1] : nullptr;  // all rows in one tile (up to kTileRows)
  // tiles sharing chunks (see kChunksPrefetchIntoL1): two fetch the next chunk's lines into L1, in memory order; of
  // three, the first prefetches its own chunk; the others, and any more, share the next chunk's zmm lines into L2
  const bool sequential_next = kChunksPrefetchIntoL1 && row_tiles == 2;
  const bool first_tile_own_prefetch = kChunksPrefetchIntoL1 && row_tiles == 3;
  const bool memory_broadcast = m <= kMemoryBroadcastMaxRows;
  const int next_parts = sequential_next ? kChunkLines : kPanelZmm;
  specdec::parallel_shares(blocks, [&](specdec::ShareCursor& cursor) {
    std::vector<__m512i> sums(row_tiles * kMaxAccumulators);  // each tile's [rows][64] int32 sums
    int32_t* acc = reinterpret_cast<int32_t*>(sums.data());
    int64_t nb;
    bool own;
    while (cursor.next(nb, own)) {
      const int8_t* panel = p + nb * steps * kStepBytes;
      // a thread's own panels follow one another in memory: one stream
      const char* next_panel = own && nb + 1 < blocks ? reinterpret_cast<const char*>(panel + steps * kStepBytes) : nullptr;
      const int64_t cols = std::min<int64_t>(kBlock, channels - nb * kBlock);
      prefetch_epilogue(ws, b, nb * kBlock, cols);
      if (row_tiles == 1) {  // one pass: memory is the bound, the stream left to the hardware prefetcher for few rows
        const Prefetch prefetch{reinterpret_cast<const char*>(panel + kPrefetchSteps * kStepBytes), nullptr, 0, 0};
        one_tile(xq.get(), row_stride, step_stride, steps, panel, prefetch, acc);
        store_rows(acc, static_cast<int>(m), 0, nb * kBlock, cols, row_sum.data(), ws, row_scale.data(), b, out, n,
                   epilogue);
        continue;
      }
      for (int64_t s0 = 0; s0 < steps; s0 += kChunkSteps) {
        const int64_t chunk = std::min(kChunkSteps, steps - s0);
        const int8_t* chunk_weights = panel + s0 * kStepBytes;
        const char* next = s0 + chunk < steps ? reinterpret_cast<const char*>(chunk_weights + chunk * kStepBytes) : next_panel;
        for (int64_t t = 0; t < row_tiles; ++t) {
          // the tiles share the next chunk's parts out between them
          const bool own_prefetch = first_tile_own_prefetch && t == 0;
          const char* own =
              own_prefetch ? reinterpret_cast<const char*>(chunk_weights + kPrefetchSteps * kStepBytes) : nullptr;
          const Prefetch prefetch{own, next, next ? static_cast<int>(t * next_parts / row_tiles) : 0,
                                  next ? static_cast<int>((t + 1) * next_parts / row_tiles) : 0};
          const ChunkTiles& tiles = sequential_next ? kChunkTilesSequentialNext[memory_broadcast]
                                    : own_prefetch  ? kChunkTilesOwnPrefetch
                                                    : kChunkTiles[memory_broadcast];
          const int rows = static_cast<int>(tile_first[t + 1] - tile_first[t]);
          tiles[s0 > 0][rows - 1](xq.get() + tile_first[t] * row_stride + s0 * step_stride, row_stride, step_stride,
                                  chunk, chunk_weights, prefetch, acc + t * kMaxAccumulators * kLanes);
        }
      }
      for (int64_t t = 0; t < row_tiles; ++t)
        store_rows(acc + t * kMaxAccumulators * kLanes, static_cast<int>(tile_first[t + 1] - tile_first[t]),
                   tile_first[t], nb * kBlock, cols, row_sum.data(), ws, row_scale.data(), b, out, n, epilogue);
    }
  });
  return y;
}

// ---- AMX: the same sums by Intel's tile multiply (Sapphire Rapids and later), from the same packed panels ----
//
// A panel's k-step holds 64 channels × 4 bytes, so 16 k-steps of 16 channels are one B tile of TDPBSUD (16 rows of
// 64 bytes, 256 bytes apart), and 64 bytes of a row-major activation row (s8) are a row of its A tile: the int32 sums
// are vpdpbusd's, exact, so the results are the VNNI path's bits. One tile multiply does 16 k-steps × 16 channels for
// up to 16 rows (1024 multiply-adds a cycle against vpdpbusd's 64), so the arithmetic of verification's rows vanishes
// under the weight stream.

// the CPU has AMX-TILE and AMX-INT8 and Linux lets this process use the tile data (it asks once, for every thread)
bool amx_usable() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) || !(edx >> 24 & 1) || !(edx >> 25 & 1)) return false;
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
  return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}
const bool kAmxUsable = amx_usable();
constexpr int64_t kAmxRows = 16;   // rows of an A tile
constexpr int64_t kAmxSteps = 16;  // k-steps of a B tile: 64 inputs
// The panel is fetched into L1 this many 16-step blocks (4 KiB each) ahead, a quarter of a block before each tile
// multiply. Over the 1.5B's 113 products (random weights, two threads, paired shuffled rounds, bitwise equal; Intel
// host with AMX, ~34 GB/s): left to the hardware prefetcher the tile loads streamed at 57.5 ms for one row against
// the VNNI path's 53.6; a whole block at once 1–3 blocks ahead, 52.8–53.3 at one row, 54.1–54.9 at 2–6, 55–56 at 8,
// 56–57 at 12, 59 at 16 (VNNI: 59, 64, 69, 77, 81, 78); 6 blocks: 54–64, 8 blocks: 62–69; into L2 (2–4 blocks):
// 58–60; every other line: 1.2×; non-temporal: 3×. One block ahead in quarters took 0.97–0.98 of the time of two
// blocks at once at 1, 4 and 8 rows (9 rounds).
constexpr int64_t kAmxPrefetchTiles = 1;

inline void amx_prefetch_quarter(const char* block, int quarter) {
#pragma GCC unroll 16
  for (int line = quarter * 16; line < (quarter + 1) * 16; ++line) _mm_prefetch(block + line * 64, _MM_HINT_T0);
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0–3: a panel's four 16-channel sums [rows][16] int32; 4: the activations; 5–7: weights
TileConfig amx_config(int rows) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = t < 5 ? rows : kAmxSteps;
    config.bytes_per_row[t] = 64;
  }
  return config;
}

// acc [rows][64] = the sums of `rows` activation rows (s8, `row_stride` bytes apart) times a panel's 64 channels
// The weight tiles are loaded with the non-temporal hint (TILELOADDT1): each line is read once. Real 1.5B int8
// forwards (paired shuffled rounds, both layer stacks in one process, logits bitwise equal; fortieth session) took
// 0.94–0.96 of the time at k = 1, 0.97–0.98 at 2–4, 0.95–0.98 at 8 and 0.98–1.00 at 16 (contexts 128 and 1024, two
// runs; the same source built twice: 0.99–1.015). Prefetched into L2 rather than L1 as well: 0.96–0.99.
// After each block's tile multiplies are issued it calls `between()`: the previous block's outputs, a row at a time
// (amx_thread).
template <class Between>
__attribute__((target("amx-tile,amx-int8"))) void amx_panel(const int8_t* xq, int64_t row_stride, int64_t steps,
                                                            const int8_t* panel, int32_t* acc, Between&& between) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t s = 0; s < steps; s += kAmxSteps) {
    const int8_t* w = panel + s * kStepBytes;
    const char* ahead = reinterpret_cast<const char*>(w + kAmxPrefetchTiles * kAmxSteps * kStepBytes);
    _tile_loadd(4, xq + s * 4, row_stride);
    amx_prefetch_quarter(ahead, 0);
    _tile_stream_loadd(5, w, kStepBytes);
    _tile_dpbsud(0, 4, 5);
    amx_prefetch_quarter(ahead, 1);
    _tile_stream_loadd(6, w + 64, kStepBytes);
    _tile_dpbsud(1, 4, 6);
    amx_prefetch_quarter(ahead, 2);
    _tile_stream_loadd(7, w + 128, kStepBytes);
    _tile_dpbsud(2, 4, 7);
    amx_prefetch_quarter(ahead, 3);
    _tile_stream_loadd(5, w + 192, kStepBytes);
    _tile_dpbsud(3, 4, 5);
    between();
  }
  _tile_stored(0, acc, kBlock * 4);
  _tile_stored(1, acc + 16, kBlock * 4);
  _tile_stored(2, acc + 32, kBlock * 4);
  _tile_stored(3, acc + 48, kBlock * 4);
}

struct AmxCall {
  const int8_t* xq;  // [row blocks × 16][kp], rows past m zero
  int64_t m, kp, steps, n, channels;
  Epilogue epilogue;
  const int8_t* packed;
  const int32_t* row_sum;
  const float *weight_scale, *row_scale, *bias;
  float* out;
};

// A block's sums (rows m0 … m0 + rows − 1 of channels col0 … col0 + cols − 1) waiting for their outputs, from row `next`
struct PendingRows {
  const int32_t* acc = nullptr;
  int next = 0, rows = 0;
  int64_t m0 = 0, col0 = 0, cols = 0;
};

// One thread's panels: every row block of each (16 rows), then its outputs. A block's outputs are written a row at a
// time between the next block's tile multiplies, from the other of two sum buffers, so that the epilogue's arithmetic
// runs while the tile unit works rather than while it waits (the same outputs, bitwise). Against the outputs written
// after each block (two threads, paired shuffled rounds, bitwise equal; Intel host): 512 rows 0.79–0.80 of the time
// over a 1.5B gate/up product, 0.89 over qkv, 0.99 over down (K = 8960: more multiplies an output), 64 rows 0.88–0.89
// over gate/up (random weights); the real 1.5B's 113 products 0.930 of the time at 512 rows (a prefill chunk), 0.988
// at 64, 1.005–1.011 at 1, 8 and 16 (within a control build's spread).
__attribute__((target("amx-tile,amx-int8"))) void amx_thread(specdec::ShareCursor& cursor, const AmxCall& call) {
  const int rows = static_cast<int>(std::min(call.m, kAmxRows));
  const TileConfig config = amx_config(rows);
  _tile_loadconfig(&config);
  alignas(64) int32_t acc[2][kAmxRows * kBlock];
  PendingRows pending;
  const auto store_pending_row = [&] {
    if (pending.next == pending.rows) return;
    store_rows(pending.acc + pending.next * kBlock, 1, pending.m0 + pending.next, pending.col0, pending.cols,
               call.row_sum, call.weight_scale, call.row_scale, call.bias, call.out, call.n, call.epilogue);
    ++pending.next;
  };
  const auto store_pending = [&] {
    while (pending.next < pending.rows) store_pending_row();
  };
  int64_t nb;
  bool own;
  int buffer = 0;
  while (cursor.next(nb, own)) {
    const int8_t* panel = call.packed + nb * call.steps * kStepBytes;
    const int64_t cols = std::min<int64_t>(kBlock, call.channels - nb * kBlock);
    prefetch_epilogue(call.weight_scale, call.bias, nb * kBlock, cols);
    for (int64_t m0 = 0; m0 < call.m; m0 += kAmxRows) {
      amx_panel(call.xq + m0 * call.kp, call.kp, call.steps, panel, acc[buffer], store_pending_row);
      store_pending();  // a panel of fewer k-blocks than rows
      pending = {acc[buffer], 0, static_cast<int>(std::min(kAmxRows, call.m - m0)), m0, nb * kBlock, cols};
      buffer ^= 1;
    }
  }
  store_pending();
  _tile_release();
}

// x [M, K] float32 → y [M, n] float32, as `linear_with` computes it, by AMX where it runs and K is a multiple of 64
torch::Tensor linear_amx_with(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scale,
                              c10::optional<torch::Tensor> bias, int64_t n, Epilogue epilogue) {
  const int64_t steps = packed.size(1);
  if (!kAmxUsable || steps % kAmxSteps != 0) return linear_with(x, packed, weight_scale, bias, n, epilogue);
  x = checked_input(x, packed);
  const int64_t channels = product_channels(packed, n, epilogue);
  const int64_t m = x.size(0), k = x.size(1), kp = steps * 4;
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  // rows past m up to a whole A tile are zero (more than one tile's rows: every tile is loaded whole)
  const int64_t padded = m <= kAmxRows ? m : (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  std::unique_ptr<int8_t[]> xq(new int8_t[padded * kp]);
  std::memset(xq.get() + m * kp, 0, (padded - m) * kp);
  std::vector<float> row_scale(m);
  std::vector<int32_t> row_sum(m);
  quantize_rows(x.data_ptr<float>(), m, k, kp, kp, 4, xq.get(), row_scale.data(), row_sum.data());
  const AmxCall call{xq.get(), m, kp, steps, n, channels, epilogue, packed.data_ptr<int8_t>(), row_sum.data(),
                     weight_scale.data_ptr<float>(), row_scale.data(),
                     bias.has_value() ? bias->data_ptr<float>() : nullptr, y.data_ptr<float>()};
  specdec::parallel_shares(packed.size(0), [&](specdec::ShareCursor& cursor) { amx_thread(cursor, call); });
  return y;
}

// the layer loop's entries (kernel_entry.h): operands {packed, weight scales[, bias]}
c10::optional<torch::Tensor> entry_bias(const std::vector<torch::Tensor>& operands) {
  TORCH_CHECK(operands.size() == 2 || operands.size() == 3, "int8 linear: operands {packed, scale[, bias]} expected");
  return operands.size() == 3 ? c10::optional<torch::Tensor>(operands[2]) : c10::nullopt;
}
// each function and entry with its epilogue bound
template <Epilogue E>
torch::Tensor linear_of(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scale,
                        c10::optional<torch::Tensor> bias, int64_t n) {
  return linear_with(x, packed, weight_scale, bias, n, E);
}
template <Epilogue E>
torch::Tensor linear_amx_of(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scale,
                            c10::optional<torch::Tensor> bias, int64_t n) {
  return linear_amx_with(x, packed, weight_scale, bias, n, E);
}
template <Epilogue E>
torch::Tensor linear_entry(const torch::Tensor& x, const std::vector<torch::Tensor>& operands, int64_t n) {
  return linear_with(x, operands[0], operands[1], entry_bias(operands), n, E);
}
template <Epilogue E>
torch::Tensor linear_amx_entry(const torch::Tensor& x, const std::vector<torch::Tensor>& operands, int64_t n) {
  return linear_amx_with(x, operands[0], operands[1], entry_bias(operands), n, E);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack", &pack);
  module.def("linear", &linear_of<Epilogue::kLinear>);
  module.attr("linear_entry") = specdec::entry::capsule<specdec::entry::Linear>(&linear_entry<Epilogue::kLinear>);
  module.def("linear_amx", &linear_amx_of<Epilogue::kLinear>);
  module.attr("linear_amx_entry") =
      specdec::entry::capsule<specdec::entry::Linear>(&linear_amx_entry<Epilogue::kLinear>);
  // a gate/up product packed for SwiGLU (n: its outputs, half its channels)
  module.def("linear_swiglu", &linear_of<Epilogue::kSwiglu>);
  module.attr("linear_swiglu_entry") =
      specdec::entry::capsule<specdec::entry::Linear>(&linear_entry<Epilogue::kSwiglu>);
  module.def("linear_amx_swiglu", &linear_amx_of<Epilogue::kSwiglu>);
  module.attr("linear_amx_swiglu_entry") =
      specdec::entry::capsule<specdec::entry::Linear>(&linear_amx_entry<Epilogue::kSwiglu>);
  module.attr("amx_usable") = kAmxUsable;
}
