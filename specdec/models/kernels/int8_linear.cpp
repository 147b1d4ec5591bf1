// int8 x int8 linear for few rows (decode and verification), AVX-512 VNNI.
//
// y[m, n] = (Σ_k xq[m, k] · W[n, k]) · s_w[n] · s_x[m] + b[n], with xq = round(x / s_x) per row (s_x = max|x| / 127)
// and exact int32 sums: a row's result never depends on the other rows (batch invariance).
// Weights are packed once into panels of 64 output channels, k-step-major: [N / 64][K / 4][64][4] (four zmm of
// vpdpbusd per k-step, read as one sequential stream); activations
// are shifted to u8 (+128) for vpdpbusd, and 128 · Σ_k W[n, k] is subtracted back.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kLanes = 16;     // output channels per zmm
constexpr int64_t kNR = 4;         // zmm of channels per micro-tile: 64 channels
constexpr int64_t kMR = 6;         // rows per micro-tile
constexpr int64_t kBlock = kLanes * kNR;
constexpr int64_t kPrefetchBytes = 2048;  // ahead of the panel stream

bool cpu_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// W [N, K] int8 → packed [Np / 64][Kp / 4][64][4], Np and Kp padded with zeros; returns (packed, colsum [Np] int32)
std::vector<torch::Tensor> pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dtype() == torch::kInt8 && weight.dim() == 2, "pack: int8 [N, K] weights expected");
  weight = weight.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1);
  const int64_t np = (n + kBlock - 1) / kBlock * kBlock, kp = (k + 3) / 4 * 4;
  auto packed = torch::zeros({np / kBlock, kp / 4, kBlock, 4}, torch::kInt8);
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

// rows of x [M, K] float → u8 (value + 128) [M, Kp] and scales [M]
void quantize_rows(const float* x, int64_t m, int64_t k, int64_t kp, uint8_t* xq, float* scale) {
  for (int64_t r = 0; r < m; ++r) {
    const float* row = x + r * k;
    __m512 vmax = _mm512_setzero_ps();
    int64_t c = 0;
    for (; c + 16 <= k; c += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
    float amax = _mm512_reduce_max_ps(vmax);
    for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
    const float s = std::max(amax, std::numeric_limits<float>::min()) / 127.0f;  // as OneDnnInt8Linear
    scale[r] = s;
    uint8_t* out = xq + r * kp;
    c = 0;
    const __m512 vs = _mm512_set1_ps(s);
    const __m512i shift = _mm512_set1_epi32(128);
    for (; c + 16 <= k; c += 16) {
      // x / s rounded to nearest even, as torch.round(x / s)
      __m512i q = _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + c), vs));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + c), _mm512_cvtepi32_epi8(_mm512_add_epi32(q, shift)));
    }
    for (; c < k; ++c) out[c] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(row[c] / s)) + 128);
    for (; c < kp; ++c) out[c] = 128;
  }
}

template <int MR>
inline void micro_tile(const uint8_t* xq, int64_t kp, const int8_t* panel, int32_t* acc_out) {
  __m512i acc[MR][kNR];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kNR; ++j) acc[m][j] = _mm512_setzero_si512();
  const int64_t steps = kp / 4;
  for (int64_t s = 0; s < steps; ++s) {
    __m512i w[kNR];
    const int8_t* step = panel + s * kBlock * 4;
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 64, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 128, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(step) + kPrefetchBytes + 192, _MM_HINT_T0);
    for (int j = 0; j < kNR; ++j) w[j] = _mm512_loadu_si512(step + j * 64);
    for (int m = 0; m < MR; ++m) {
      const __m512i a = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(xq + m * kp + s * 4));
      for (int j = 0; j < kNR; ++j) acc[m][j] = _mm512_dpbusd_epi32(acc[m][j], a, w[j]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < kNR; ++j) _mm512_storeu_si512(acc_out + m * kBlock + j * kLanes, acc[m][j]);
}

void tile_rows(int mr, const uint8_t* xq, int64_t kp, const int8_t* panel, int32_t* acc) {
  switch (mr) {
    case 1: return micro_tile<1>(xq, kp, panel, acc);
    case 2: return micro_tile<2>(xq, kp, panel, acc);
    case 3: return micro_tile<3>(xq, kp, panel, acc);
    case 4: return micro_tile<4>(xq, kp, panel, acc);
    case 5: return micro_tile<5>(xq, kp, panel, acc);
    default: return micro_tile<6>(xq, kp, panel, acc);
  }
}

// x [M, K] float32 → y [M, N] float32
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, torch::Tensor colsum, torch::Tensor weight_scale,
                     c10::optional<torch::Tensor> bias, int64_t n) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2, "int8 linear: float32 [M, K] input expected");
  x = x.contiguous();
  const int64_t m = x.size(0), k = x.size(1), kp = packed.size(1) * 4, blocks = packed.size(0);
  TORCH_CHECK(kp == (k + 3) / 4 * 4, "int8 linear: input has ", k, " features");
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  std::vector<uint8_t> xq(m * kp);
  std::vector<float> row_scale(m);
  quantize_rows(x.data_ptr<float>(), m, k, kp, xq.data(), row_scale.data());
  const int8_t* p = packed.data_ptr<int8_t>();
  const int32_t* cs = colsum.data_ptr<int32_t>();
  const float* ws = weight_scale.data_ptr<float>();
  const float* b = bias.has_value() ? bias->data_ptr<float>() : nullptr;
  float* out = y.data_ptr<float>();
  // rows split into near-equal tiles of at most kMR (8 rows: 4 + 4, not 6 + 2: a thin tile re-reads the panel
  // for little arithmetic)
  const int64_t tiles = (m + kMR - 1) / kMR;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t acc[kMR * kBlock];
    for (int64_t nb = begin; nb < end; ++nb) {
      const int8_t* panel = p + nb * kp * kBlock;
      const int64_t cols = std::min<int64_t>(kBlock, n - nb * kBlock);
      for (int64_t t = 0, m0 = 0; t < tiles; ++t) {
        const int mr = static_cast<int>((m - m0) / (tiles - t) + ((m - m0) % (tiles - t) != 0));
        tile_rows(mr, xq.data() + m0 * kp, kp, panel, acc);
        for (int r = 0; r < mr; ++r) {
          const __m512 rs = _mm512_set1_ps(row_scale[m0 + r]);
          float* dst = out + (m0 + r) * n + nb * kBlock;
          for (int64_t c = 0; c < cols; c += kLanes) {
            const int64_t col = nb * kBlock + c;
            const __mmask16 mask = cols - c >= kLanes ? 0xFFFF : static_cast<__mmask16>((1u << (cols - c)) - 1);
            const __m512i sums = _mm512_sub_epi32(_mm512_load_si512(acc + r * kBlock + c),
                                                  _mm512_slli_epi32(_mm512_maskz_loadu_epi32(mask, cs + col), 7));
            __m512 v = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_maskz_loadu_ps(mask, ws + col)), rs);
            if (b) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, b + col));
            _mm512_mask_storeu_ps(dst + c, mask, v);
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
  module.def("cpu_supported", &cpu_supported);
  module.def("pack", &pack);
  module.def("linear", &linear);
}
