// int4 weights x int8 rows, AVX-512 VNNI: a draft model's format, half the bytes of int8.
//
// y[m, n] = s_x[m] · Σ_g (s[n, g] · Σ_{k∈g} xq[m, k] · q[n, k] − o[n, g] · Σ_{k∈g} xq[m, k]) + b[n], groups g of 128
// in-features, q ∈ 0…15 (zero point z = o / s), xq = round(x / s_x) per row (s_x = max|x| / 127). Each group's sums are
// exact int32 and the groups are added in order in float32, so a row's result never depends on the other rows.
// Weights are packed once into panels of 64 output channels, [N / 64][K / 8][64][4] bytes on 2 MiB pages
// (huge_pages.h): byte i of channel c in k-block j holds q[c, 8j + i] in its low nibble and q[c, 8j + 4 + i] in its
// high one, so one zmm load, an and and a shift give vpdpbusd two k-steps of 16 channels (the nibbles are its unsigned
// operand, the activations its signed one). Scales and offsets: [N / 64][K / 128][64] float.
// Rows are taken 6 at a time over a panel (the panel stays in L2 for the next 6); the stream is left to the hardware
// prefetcher (one 209 MB product read 0.84 of the read-bandwidth probe at one row and 0.68 at four, with 4-row tiles
// whose float sums took registers; 0.59–0.65 with 16 or 32 k-blocks fetched ahead into L1, on a Zen 4 host: not yet at
// the stream). The 0.5B's 96 layer products (its prototype) took 0.64× the VNNI int8 kernel's time at 1–2 rows and
// 0.70× at 4, its draft forwards in the engine ~7.5 ms against ~11.6 (BENCHMARKS.md, forty-seventh session). The tiles
// now keep their float sums in L1 and take the activations as vpdpbusd's memory operand, so 6 rows fit the registers
// (4 rows' sums had spilled): over the 0.5B's 96 layer products (random weights, two threads, 20 shuffled paired
// rounds, bitwise equal; Zen 4 host) 0.92 of the former time at 4 and 6 rows, 0.94 at 32, 0.91 at 256 (in L3), 1.01 and
// 0.99 at 1 and 2 (quartiles 0.95–1.03).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>

#include "huge_pages.h"
#include "kernel_entry.h"
#include "row_quantize.h"
#include "shared_work.h"

namespace {

constexpr int64_t kGroup = 128, kPanel = 64, kBlockBytes = kPanel * 4, kTileRows = 6;
constexpr int64_t kBlocksPerGroup = kGroup / 8;

// [N / 64, K / 8, 64, 4] nibble bytes → the same on 2 MiB pages
torch::Tensor pack(torch::Tensor nibbles) {
  TORCH_CHECK(nibbles.dtype() == torch::kUInt8 && nibbles.dim() == 4 && nibbles.size(2) == kPanel && nibbles.size(3) == 4,
              "int4 pack: uint8 [N / 64, K / 8, 64, 4] expected");
  TORCH_CHECK(nibbles.size(1) % kBlocksPerGroup == 0, "int4 pack: in-features must be a multiple of ", kGroup);
  auto packed = specdec::zeros_on_huge_pages(nibbles.sizes(), torch::kUInt8);
  packed.copy_(nibbles);
  return packed;
}

// xq [m][kp] (zeros past k), s_x [m] and the sums of xq over each group [m][kp / 128]
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t kp, int8_t* xq, float* scale, int32_t* group_sums) {
  const int64_t groups = kp / kGroup;
  at::parallel_for(0, m, std::max<int64_t>(1, (32 << 10) / k), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * k;
      const float s = specdec::row_scale(row, k);
      scale[r] = s;
      int8_t* out = xq + r * kp;
      int32_t* sums = group_sums + r * groups;
      std::fill(sums, sums + groups, 0);
      specdec::quantize_row(
          row, k, s,
          [&](int64_t c, __m512i q) {
            _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm512_cvtepi32_epi8(q));
            sums[c / kGroup] += _mm512_reduce_add_epi32(q);  // 16 divides 128: a vector never spans two groups
          },
          [&](int64_t c, int32_t q) {
            out[c] = static_cast<int8_t>(q);
            sums[c / kGroup] += q;
          });
      std::fill(out + k, out + kp, 0);
    }
  });
}

// acc [R][64] = one panel's sums for rows 0 … R − 1 of xq (stride kp), in float, group by group. The float sums wait
// in acc (L1) between groups, so the registers hold only the R × 4 int32 group sums, the weights and the nibble mask;
// each row's 4 bytes of a k-step are vpdpbusd's broadcast memory operand ({1to16}), as in int8_linear.cpp.
template <int R>
void panel_tile(const int8_t* xq, int64_t kp, const int32_t* group_sums, const uint8_t* panel, const float* scale,
                const float* offset, float* acc) {
  static_assert(R * 4 + 4 <= 32, "more zmm than there are");
  const int64_t groups = kp / kGroup;
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_store_ps(acc + r * kPanel + c * 16, _mm512_setzero_ps());
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    __m512i dots[R][4];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) dots[r][c] = _mm512_setzero_si512();
    for (int64_t j = g * kBlocksPerGroup; j < (g + 1) * kBlocksPerGroup; ++j) {
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512i bytes = _mm512_loadu_si512(panel + j * kBlockBytes + c * 64);
        const __m512i low = _mm512_and_si512(bytes, low_nibbles);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const auto* x4 = reinterpret_cast<const int32_t*>(xq + r * kp + 8 * j);
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dots[r][c]) : "v"(low), "m"(x4[0]));
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dots[r][c]) : "v"(high), "m"(x4[1]));
        }
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x_sum = _mm512_set1_ps(static_cast<float>(group_sums[r * groups + g]));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const __m512 s = _mm512_loadu_ps(scale + g * kPanel + c * 16), o = _mm512_loadu_ps(offset + g * kPanel + c * 16);
        float* sums = acc + r * kPanel + c * 16;
        _mm512_store_ps(sums, _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][c]), s,
                                              _mm512_fnmadd_ps(o, x_sum, _mm512_load_ps(sums))));
      }
    }
  }
}

using TileFn = void (*)(const int8_t*, int64_t, const int32_t*, const uint8_t*, const float*, const float*, float*);
constexpr TileFn kTiles[kTileRows] = {panel_tile<1>, panel_tile<2>, panel_tile<3>,
                                       panel_tile<4>, panel_tile<5>, panel_tile<6>};

// x [M, K] float32 → y [M, n] float32; packed [N / 64, Kp / 8, 64, 4], scale and offset [N / 64, Kp / 128, 64]
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor offset,
                     c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int4 linear: float32 [M, K] expected");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), panels = packed.size(0), kp = packed.size(1) * 8, groups = kp / kGroup;
  TORCH_CHECK(k <= kp && kp - k < kGroup, "int4 linear: input has ", k, " features, the weights ", kp, " (padded)");
  TORCH_CHECK(panels == (n + kPanel - 1) / kPanel, "int4 linear: ", n, " outputs do not fit ", panels, " panels");
  TORCH_CHECK(scale.size(0) == panels && scale.size(1) == groups && offset.sizes() == scale.sizes(),
              "int4 linear: scales and offsets [N / 64, K / 128, 64] expected");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  std::unique_ptr<int8_t[]> xq(new int8_t[m * kp]);
  std::unique_ptr<float[]> row_scale(new float[m]);
  std::unique_ptr<int32_t[]> group_sums(new int32_t[m * groups]);
  quantize_rows(x.data_ptr<float>(), m, k, kp, xq.get(), row_scale.get(), group_sums.get());
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const float* s = scale.data_ptr<float>();
  const float* o = offset.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  specdec::parallel_shares(panels, [&](specdec::ShareCursor& cursor) {
    alignas(64) float acc[kTileRows * kPanel];
    int64_t panel;
    while (cursor.next(panel)) {
      const int64_t col = panel * kPanel, width = std::min(kPanel, n - col);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int64_t rows = std::min(kTileRows, m - r0);
        kTiles[rows - 1](xq.get() + r0 * kp, kp, group_sums.get() + r0 * groups, p + panel * (kp / 8) * kBlockBytes,
                         s + panel * groups * kPanel, o + panel * groups * kPanel, acc);
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t c = 0; c < width; ++c)
            out[(r0 + r) * n + col + c] = acc[r * kPanel + c] * row_scale[r0 + r] + (b ? b[col + c] : 0.f);
      }
    }
  });
  return y;
}

// the layer loop's entry (kernel_entry.h): operands {packed, scale, offset} or {packed, scale, offset, bias}
torch::Tensor linear_entry(const torch::Tensor& x, const std::vector<torch::Tensor>& operands, int64_t n) {
  TORCH_CHECK(operands.size() == 3 || operands.size() == 4, "int4 linear: operands {packed, scale, offset[, bias]}");
  return linear(x, operands[0], operands[1], operands[2],
                operands.size() == 4 ? c10::optional<torch::Tensor>(operands[3]) : c10::nullopt, n);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("pack", &pack);
  module.def("linear", &linear);
  module.attr("linear_entry") = specdec::entry::capsule<specdec::entry::Linear>(&linear_entry);
}
