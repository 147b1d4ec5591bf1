// int8 x int8 linear on AVX2 CPUs without VNNI (decode, verification and prefill rows).
//
// Computes what int8_linear.cpp computes, bit for bit: y[m, n] = (Σ_k xq[m, k] · W[n, k]) · s_w[n] · s_x[m] + b[n],
// xq = round(x / s_x) per row (s_x = max|x| / 127), the sums exact in int32, so a row's result never depends on the
// other rows (batch invariance). Without VNNI the products go through vpmaddwd: weights and activations widened to
// int16, each instruction 16 exact multiply-adds into int32 pairs. vpmaddubsw does 32, exact once vpsignb moves the
// sign onto the weights, but with the vpmaddwd that widens its sums it measured 1.10–1.23× slower at 1 and 6–16 rows
// (Zen 3, the 1.5B's products; 0.95 at 4 rows, 0.83 at 64).
// Weights are packed once into panels of 16 output channels, k-pair-major: [N / 16][K / 2][16][2], each panel one
// sequential stream of 32-byte steps (two ymm once widened), prefetched ahead, on 2 MiB pages (huge_pages.h). Up to
// 6 rows form one tile (12 accumulators + 2 weights + a broadcast and a product: the 16 ymm) that streams a panel
// once from memory; more rows take several tiles over chunks of K small enough to stay in L1, the int32 partial sums
// waiting in a buffer between chunks (exact: integer sums in any order are the same).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

#include "huge_pages.h"
#include "kernel_entry.h"
#include "shared_work.h"

namespace {

constexpr int64_t kLanes = 8;                 // int32 channels per ymm
constexpr int64_t kPanel = 2 * kLanes;        // channels per panel
constexpr int64_t kStepBytes = kPanel * 2;    // one k-pair of a panel
constexpr int kMaxTileRows = 6;
constexpr int64_t kChunkSteps = 512;          // k-pairs per chunk when several tiles share a panel: 16 KiB of L1
// Each stream is prefetched this far ahead into L1, one line per two steps. Zen 3 host, the 1.5B's 113 products,
// shuffled A/B, 4–5 rounds: 1 / 4 / 8 rows took 0.86 / 0.68 / 0.85 of the time of the hardware prefetcher alone
// (384–768 bytes ahead: 0.87–1.01 / 0.79–0.81 / 0.93–0.96; 4–8 KiB: within 7% of 2 KiB)
constexpr int64_t kPrefetchBytes = 2048;

// W [N, K] int8 → packed [Np / 16][Kp / 2][16][2], Np and Kp padded with zeros
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2, "pack: int8 [N, K] weights expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t panels = (n + kPanel - 1) / kPanel, steps = (k + 1) / 2;
  auto packed = specdec::zeros_on_huge_pages({panels, steps, kPanel, 2}, torch::kInt8);
  const int8_t* w = weight.data_ptr<int8_t>();
  int8_t* p = packed.data_ptr<int8_t>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t panel = row / kPanel, lane = row % kPanel;
      for (int64_t col = 0; col < k; ++col) p[((panel * steps + col / 2) * kPanel + lane) * 2 + col % 2] = w[row * k + col];
    }
  });
  return packed;
}

// one row of x [K] float → int16 round(x / s) at out [Kp] (padding zero), and s
void quantize_row(const float* row, int64_t k, int64_t kp, int16_t* out, float* scale) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= k; c += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(row + c)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float amax = *std::max_element(lanes, lanes + 8);
  for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  const float s = std::max(amax, std::numeric_limits<float>::min()) / 127.0f;  // as OneDnnInt8Linear
  *scale = s;
  const __m256 vs = _mm256_set1_ps(s);
  for (c = 0; c + 8 <= k; c += 8) {
    // x / s rounded to nearest even, as torch.round(x / s); |q| ≤ 127, so packing to int16 is exact
    const __m256i q = _mm256_cvtps_epi32(_mm256_div_ps(_mm256_loadu_ps(row + c), vs));
    const __m128i q16 = _mm_packs_epi32(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), q16);
  }
  for (; c < k; ++c) out[c] = static_cast<int16_t>(std::nearbyint(row[c] / s));
  for (; c < kp; ++c) out[c] = 0;
}

// acc [MR][16] (+)= Σ over k-pairs [0, steps) of rows xq + m · kp (int16) times a panel's channels; starts from
// zero or from the sums in acc
template <int MR>
void micro_tile(const int16_t* xq, int64_t kp, int64_t steps, const int8_t* panel, bool resume, int32_t* acc_io) {
  __m256i acc[MR][2];
  // loops over rows unrolled whole, so GCC keeps the accumulators in registers
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j)
      acc[m][j] = resume ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc_io + (m * 2 + j) * kLanes))
                         : _mm256_setzero_si256();
  for (int64_t s = 0; s < steps; ++s) {
    const int8_t* step = panel + s * kStepBytes;
    if ((s & 1) == 0) _mm_prefetch(reinterpret_cast<const char*>(step + kPrefetchBytes), _MM_HINT_T0);
    const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step)));
    const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(step + 16)));
#pragma GCC unroll 6
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, xq + m * kp + 2 * s, sizeof pair);
      const __m256i a = _mm256_set1_epi32(pair);
      acc[m][0] = _mm256_add_epi32(acc[m][0], _mm256_madd_epi16(w0, a));
      acc[m][1] = _mm256_add_epi32(acc[m][1], _mm256_madd_epi16(w1, a));
    }
  }
#pragma GCC unroll 6
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(acc_io + (m * 2 + j) * kLanes), acc[m][j]);
}

using TileFn = void (*)(const int16_t*, int64_t, int64_t, const int8_t*, bool, int32_t*);

template <int... MR>
constexpr std::array<TileFn, sizeof...(MR)> tiles_of(std::integer_sequence<int, MR...>) {
  return {&micro_tile<MR + 1>...};
}
const auto kTiles = tiles_of(std::make_integer_sequence<int, kMaxTileRows>{});

// x [M, K] float32 → y [M, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor weight_scale, c10::optional<torch::Tensor> bias,
                     int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int8 linear: float32 [M, K] input expected");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), steps = packed.size(1), kp = steps * 2;
  TORCH_CHECK(kp == (k + 1) / 2 * 2, "int8 linear: input has ", k, " features");
  TORCH_CHECK(panels == (n + kPanel - 1) / kPanel, "int8 linear: ", n, " outputs do not fit ", panels, " panels");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  std::unique_ptr<int16_t[]> xq(new int16_t[m * kp]);  // not zeroed: quantize_row writes every element
  std::vector<float> row_scale(m);
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, m, 32, [&](int64_t begin, int64_t end) {  // split for prefill only
    for (int64_t r = begin; r < end; ++r) quantize_row(xs + r * k, k, kp, xq.get() + r * kp, row_scale.data() + r);
  });
  const int8_t* p = packed.data_ptr<int8_t>();
  const float* ws = weight_scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  const int64_t row_tiles = (m + kMaxTileRows - 1) / kMaxTileRows;
  const int64_t chunk = row_tiles == 1 ? steps : kChunkSteps;
  specdec::parallel_shares(panels, [&](specdec::ShareCursor& cursor) {
    std::unique_ptr<int32_t[]> acc(new int32_t[m * kPanel]);  // not zeroed: every tile's first chunk starts from zero
    int64_t panel;
    while (cursor.next(panel)) {
      const int8_t* weights = p + panel * steps * kStepBytes;
      for (int64_t s0 = 0; s0 < steps; s0 += chunk) {
        const int64_t here = std::min(chunk, steps - s0);
        for (int64_t t = 0, m0 = 0; t < row_tiles; ++t) {
          const int64_t mr = (m - m0 + row_tiles - t - 1) / (row_tiles - t);  // near-equal tiles
          kTiles[mr - 1](xq.get() + m0 * kp + 2 * s0, kp, here, weights + s0 * kStepBytes, s0 > 0, acc.get() + m0 * kPanel);
          m0 += mr;
        }
      }
      // the same float operations in the same order as int8_linear.cpp and oneDNN: sum · s_w · s_x + b
      const int64_t col = panel * kPanel, width = std::min(kPanel, n - col);
      for (int64_t r = 0; r < m; ++r) {
        const int32_t* sums = acc.get() + r * kPanel;
        float* dst = out + r * n + col;
        const __m256 rs = _mm256_set1_ps(row_scale[r]);
        int64_t c = 0;
        for (; c + kLanes <= width; c += kLanes) {
          const __m256i sum = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(sums + c));
          __m256 v = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(sum), _mm256_loadu_ps(ws + col + c)), rs);
          if (b) v = _mm256_add_ps(v, _mm256_loadu_ps(b + col + c));
          _mm256_storeu_ps(dst + c, v);
        }
        for (; c < width; ++c) {
          float v = static_cast<float>(sums[c]) * ws[col + c] * row_scale[r];
          if (b) v += b[col + c];
          dst[c] = v;
        }
      }
    }
  });
  return y;
}

// the layer loop's entry (kernel_entry.h): operands {packed, weight scales[, bias]}
torch::Tensor linear_entry(const torch::Tensor& x, const std::vector<torch::Tensor>& operands, int64_t n) {
  TORCH_CHECK(operands.size() == 2 || operands.size() == 3, "int8 linear: operands {packed, scale[, bias]} expected");
  return linear(x, operands[0], operands[1], operands.size() == 3 ? c10::optional<torch::Tensor>(operands[2]) : c10::nullopt,
                n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack", &pack);
  module.def("linear", &linear);
  module.attr("linear_entry") = specdec::entry::capsule<specdec::entry::Linear>(&linear_entry);
}
