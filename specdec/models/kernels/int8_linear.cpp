// int8 x int8 linear for few rows (decode and verification), AVX-512 VNNI.
//
// y[m, n] = (Σ_k xq[m, k] · W[n, k]) · s_w[n] · s_x[m] + b[n], with xq = round(x / s_x) per row (s_x = max|x| / 127)
// and exact int32 sums: a row's result never depends on the other rows (batch invariance).
// Weights are packed once into panels of 64 output channels, k-step-major: [N / 64][K / 4][64][4] (four zmm of
// vpdpbusd per k-step, read as one sequential stream), on 2 MiB pages (huge_pages.h); activations are shifted to u8
// (+128) for vpdpbusd, and 128 · Σ_k W[n, k] is subtracted back.
// Up to 12 rows form one tile of ≤ 24 accumulators (≤ 6 rows × 64 channels, ≤ 12 × 32): one or two passes over a
// panel. More rows take tiles of ≤ 6 rows × 64 channels, one pass each (16–24 rows: 0.87–0.93 of the time of one
// tile of ≤ 24 rows × 16 channels in four passes, the 1.5B's products; 13–15 rows within noise). The first pass
// streams the panel from memory; every pass also prefetches its share of the thread's next panel into L2, so the
// stream overlaps the arithmetic of all passes (without that, 8 rows cost ~1.5× 6 rows: the second pass computed
// while memory idled).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <array>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "huge_pages.h"

namespace {

constexpr int64_t kLanes = 16;     // output channels per zmm
constexpr int64_t kPanelZmm = 4;   // zmm of channels per packed panel: 64 channels
constexpr int64_t kBlock = kLanes * kPanelZmm;
constexpr int64_t kStepBytes = kBlock * 4;  // one k-step (4 inputs) of a panel
constexpr int kMaxAccumulators = 24;        // + the weights and a broadcast: within the 32 zmm
constexpr int64_t kOneTileMaxRows = kMaxAccumulators / 2;  // over 32 channels; more rows: tiles of ≤ 6
constexpr int64_t kPrefetchSteps = 8;  // ahead of the panel stream
// Decode and verification calls of one to five rows (one pass) leave their stream to the hardware prefetcher. On 2
// MiB pages that took 0.76–0.92 (2 rows) and 0.85–0.95 (3 rows) of the time with the near and far prefetches (the
// 1.5B's products, interleaved A/B in shuffled order, fast memory; 4 and 5 rows already did so on 4 KiB pages:
// 6–11% faster); one row, on this Zen 4 host: 0.90 of the time over the 1.5B's products (slow memory), 0.82–0.84
// over 256 MiB products (fast memory, where it then reads about as fast as a sum); 6 rows took 1.03–1.06 without
// them, so they keep them
constexpr int kHardwarePrefetchMaxRows = 5;

// W [N, K] int8 → packed [Np / 64][Kp / 4][64][4], Np and Kp padded with zeros; returns (packed, colsum [Np] int32)
std::vector<torch::Tensor> pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2, "pack: int8 [N, K] weights expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t np = (n + kBlock - 1) / kBlock * kBlock, kp = (k + 3) / 4 * 4;
  auto packed = specdec::zeros_on_huge_pages({np / kBlock, kp / 4, kBlock, 4}, torch::kInt8);
  auto colsum = torch::zeros({np}, torch::kInt32);
  const int8_t* w = weight.data_ptr<int8_t>();
  int8_t* p = packed.data_ptr<int8_t>();
  int32_t* s = colsum.data_ptr<int32_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t block = row / kBlock, lane = row % kBlock;
      int32_t sum = 0;
      for (int64_t col = 0; col < k; ++col) {
        const int8_t v = w[row * k + col];
        p[((block * (kp / 4) + col / 4) * kBlock + lane) * 4 + col % 4] = v;
        sum += v;
      }
      s[row] = sum;
    }
  });
  return {packed, colsum};
}

// one row of x [K] float → u8 (value + 128) at out + (c / 4) · step_stride + c % 4, and its scale
void quantize_row(const float* row, int64_t k, int64_t kp, int64_t step_stride, uint8_t* out, float* scale) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  const float s = std::max(amax, std::numeric_limits<float>::min()) / 127.0f;  // as OneDnnInt8Linear
  *scale = s;
  c = 0;
  const __m512 vs = _mm512_set1_ps(s);
  const __m512i shift = _mm512_set1_epi32(128);
  for (; c + 16 <= k; c += 16) {
    // x / s rounded to nearest even, as torch.round(x / s)
    __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + c), vs));
    alignas(16) uint32_t groups[4];
    _mm_store_si128(reinterpret_cast<__m128i*>(groups), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, shift)));
    if (step_stride == 4) {
      std::memcpy(out + c, groups, 16);
    } else {
      for (int g = 0; g < 4; ++g) std::memcpy(out + (c / 4 + g) * step_stride, groups + g, 4);
    }
  }
  for (; c < k; ++c) out[(c / 4) * step_stride + c % 4] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(row[c] / s)) + 128);
  for (; c < kp; ++c) out[(c / 4) * step_stride + c % 4] = 128;
}

// rows of x [M, K] → xq with element (r, c) at r · row_stride + (c / 4) · step_stride + c % 4: k-step-major
// (row_stride 4, step_stride 4M) when one tile takes all rows, so a k-step's broadcasts share a cache line, else
// row-major (row_stride Kp, step_stride 4), so a tile's rows stay in few lines
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t kp, int64_t row_stride, int64_t step_stride,
                   uint8_t* xq, float* scale) {
  at::parallel_for(0, m, 32, [&](int64_t begin, int64_t end) {  // split for prefill only
    for (int64_t r = begin; r < end; ++r) quantize_row(x + r * k, k, kp, step_stride, xq + r * row_stride, scale + r);
  });
}

// What a pass over a panel prefetches at each k-step s: the lines it reads of its own step s + kPrefetchSteps into
// L1 (all four in the first pass, which streams the panel from memory), and lines [next_first, next_end) of the
// next panel's step s into L2.
struct Prefetch {
  const char* own;
  bool own_all_lines;
  const char* next;
  int next_first, next_end;
};

// acc [MR][NR·16] = Σ over k-steps of rows m0 … m0 + MR − 1 times channels j0·16 … (j0 + NR)·16 − 1 of a panel
template <int MR, int NR, bool kStepMajor>
void micro_tile(const uint8_t* xq, int64_t row_stride, int64_t step_stride, int64_t steps, const int8_t* panel,
                Prefetch prefetch, int32_t* acc_out) {
  // every loop over rows and channels unrolled whole: GCC keeps the accumulators in registers only then (without
  // the pragmas, 24 of them spill and the tile runs at half speed)
  constexpr bool kHardwarePrefetchOnly = kStepMajor && NR == kPanelZmm && MR <= kHardwarePrefetchMaxRows;
  __m512i acc[MR][NR];
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_setzero_si512();
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* step = panel + s * kStepBytes;
    const char* own = prefetch.own + s * kStepBytes;
    if constexpr (!kHardwarePrefetchOnly) {
      if (NR == kPanelZmm || prefetch.own_all_lines) {
#pragma GCC unroll 4
        for (int j = 0; j < kPanelZmm; ++j) _mm_prefetch(own + j * 64, _MM_HINT_T0);
      } else {
#pragma GCC unroll 4
        for (int j = 0; j < NR; ++j) _mm_prefetch(own + j * 64, _MM_HINT_T0);
      }
    }
    for (int j = prefetch.next_first; j < prefetch.next_end; ++j)
      _mm_prefetch(prefetch.next + s * kStepBytes + j * 64, _MM_HINT_T1);
    __m512i w[NR];
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) w[j] = _mm512_loadu_si512(step + j * 64);
    const uint8_t* a_step = xq + s * step_stride;
#pragma GCC unroll 32
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(a_step + m * (kStepMajor ? 4 : row_stride)));
#pragma GCC unroll 4
      for (int j = 0; j < NR; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], a, w[j]);
    }
  }
#pragma GCC unroll 32
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) _mm512_storeu_si512(acc_out + (m * NR + j) * kLanes, acc[m][j]);
}

using TileFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, Prefetch, int32_t*);

template <int NR, bool kStepMajor, int... MR>
constexpr std::array<TileFn, sizeof...(MR)> tiles_of(std::integer_sequence<int, MR...>) {
  return {&micro_tile<MR + 1, NR, kStepMajor>...};
}
// all rows in one tile, k-step-major: 1 … 12 / 6 rows over 2 / 4 zmm of channels; more rows, row-major: tiles of
// 1 … 6 over 4
const auto kTiles2 = tiles_of<2, true>(std::make_integer_sequence<int, kMaxAccumulators / 2>{});
const auto kTiles4 = tiles_of<4, true>(std::make_integer_sequence<int, kMaxAccumulators / 4>{});
const auto kRowMajorTiles4 = tiles_of<4, false>(std::make_integer_sequence<int, kMaxAccumulators / 4>{});

// x [M, K] float32 → y [M, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor colsum, torch::Tensor weight_scale,
                     c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int8 linear: float32 [M, K] input expected");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), steps = packed.size(1), kp = steps * 4, blocks = packed.size(0);
  TORCH_CHECK(kp == (k + 3) / 4 * 4, "int8 linear: input has ", k, " features");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  std::unique_ptr<uint8_t[]> xq(new uint8_t[m * kp]);  // not zeroed: quantize_rows writes every byte
  std::vector<float> row_scale(m);
  const int8_t* p = packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  // channels per pass (zmm): as many as the rows leave accumulators for; past 12 rows, near-equal tiles of ≤ 6
  const int nr = m > 6 && m <= kOneTileMaxRows ? 2 : 4;
  const int64_t max_rows = kMaxAccumulators / nr;
  const int64_t row_tiles = (m + max_rows - 1) / max_rows;
  const int64_t row_stride = row_tiles == 1 ? 4 : kp, step_stride = row_tiles == 1 ? m * 4 : 4;
  quantize_rows(x.data_ptr<float>(), m, k, kp, row_stride, step_stride, xq.get(), row_scale.data());
  const TileFn* tiles = row_tiles > 1 ? kRowMajorTiles4.data() : nr == 4 ? kTiles4.data() : kTiles2.data();
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kMaxAccumulators * kLanes];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int8_t* panel = p + nb * steps * kStepBytes;
      const char* next_panel = nb + 1 < end ? reinterpret_cast<const char*>(panel + steps * kStepBytes) : nullptr;
      const int64_t cols = std::min<int64_t>(kBlock, n - nb * kBlock);
      const int64_t passes_per_tile = ((cols + kLanes - 1) / kLanes + nr - 1) / nr;  // zmm of channels / nr
      const int64_t passes = row_tiles * passes_per_tile;
      for (int64_t t = 0, m0 = 0, pass = 0; t < row_tiles; ++t) {
        const int mr = static_cast<int>((m - m0) / (row_tiles - t) + ((m - m0) % (row_tiles - t) != 0));
        for (int64_t j0 = 0; j0 < kPanelZmm && j0 * kLanes < cols; j0 += nr, ++pass) {
          // the passes share the next panel's lines out between them (one pass: memory is the bound, left alone)
          const bool share = next_panel && passes > 1;
          const int first = share ? static_cast<int>(pass * kPanelZmm / passes) : 0;
          const int last = share ? static_cast<int>((pass + 1) * kPanelZmm / passes) : 0;
          const Prefetch prefetch{reinterpret_cast<const char*>(panel + j0 * 64 + kPrefetchSteps * kStepBytes),
                                  pass == 0, next_panel, first, last};
          tiles[mr - 1](xq.get() + m0 * row_stride, row_stride, step_stride, steps, panel + j0 * 64, prefetch, acc);
          const int64_t width = std::min<int64_t>(nr * kLanes, cols - j0 * kLanes);
          for (int r = 0; r < mr; ++r) {
            const __m512 rs = _mm512_set1_ps(row_scale[m0 + r]);
            float* dst = out + (m0 + r) * n + nb * kBlock + j0 * kLanes;
            for (int64_t c = 0; c < width; c += kLanes) {
              const int64_t col = nb * kBlock + j0 * kLanes + c;
              const __mmask16 mask = width - c >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (width - c)) - 1);
              const __m512i sums = _mm512_sub_epi32(_mm512_load_si512(acc + r * nr * kLanes + c),
                                                    _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, cs + col), 7));
              __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_maskz_loadu_ps(mask, ws + col)), rs);
              if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b + col));
              _mm512_mask_storeu_ps(dst + c, mask, v);
            }
          }
        }
        m0 += mr;
      }
    }
  });
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack", &pack);
  module.def("linear", &linear);
}
