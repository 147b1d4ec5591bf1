// Attention for the few new tokens of a decode or verification step, every row on its own, AVX-512: RoPE, the
// KV-cache write and the attention of a layer in one call (one call per layer and sequence replaces a dozen
// PyTorch ops and an attention call per row).
//
// Row i (a new token) attends to the cached keys 0 … cached − 1, then to the new tokens it sees: 0 … i (causal) or
// its tree path (ancestors, then itself). Each (row, KV head) is one work item: the row's query heads of that KV
// group are scored against the keys in order, softmaxed and summed over the values in a fixed order, so a row's
// result depends only on its query and the keys and values it sees, never on the other rows or the thread count
// (batch invariance: a verified row is bitwise the one-token step's).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "vector_math.h"

namespace {

using specdec::exp_nonpositive;
using specdec::kLanes;
using specdec::lane_mask;

constexpr int kChunks = 8;  // zmm per block of a head's dimensions (≤ 128 floats): accumulators kept in registers

// a zmm of floats; masked only where the head dimension is not a whole number of blocks
template <bool MASKED>
__m512 load(__mmask16 mask, const float* p) {
  if constexpr (MASKED) return _mm512_maskz_loadu_ps(mask, p);
  return _mm512_loadu_ps(p);
}

// Sixteen vectors' lane sums in one vector (lane t: the sum of v[t]), each by the same addition tree whatever its
// slot: pairs within 128-bit quarters, then the quarter, then the quarters pairwise
__m512 lane_sums(const __m512 (&v)[kLanes]) {
  __m512 x[8], y[4];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(x[2 * i], x[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[0], y[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(y[2], y[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(u0, u1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// s_g[j] = scale · q_g · k[positions[j]] for the group's heads g (queries d floats apart, scores `stride` apart) and
// j < length: each key's products folded per lane over the dimensions in order (fused multiply-adds), the lanes
// summed by `lane_sums`. Sixteen keys at a time for all heads, so a block of keys is read from L2 once and from L1
// by the other heads; positions are padded to a multiple of sixteen with valid keys, so the sixteen accumulators
// have fixed registers (the padding's scores are not stored).
template <int CHUNKS, bool MASKED>
void scores(const float* q, int64_t group, const float* keys, const int64_t* positions, int64_t length, int64_t d,
            float scale, float* s, int64_t stride) {
  for (int64_t j0 = 0; j0 < length; j0 += kLanes) {
    for (int64_t g = 0; g < group; ++g) {
      __m512 part[kLanes];
#pragma GCC unroll 16
      for (int t = 0; t < kLanes; ++t) part[t] = _mm512_setzero_ps();
      for (int64_t base = 0; base < d; base += CHUNKS * kLanes) {
        __m512 qv[CHUNKS];
        __mmask16 masks[CHUNKS];
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; ++c) {
          masks[c] = lane_mask(d - base - c * kLanes);
          qv[c] = load<MASKED>(masks[c], q + g * d + base + c * kLanes);
        }
#pragma GCC unroll 16
        for (int t = 0; t < kLanes; ++t) {
          const float* k = keys + positions[j0 + t] * d + base;
#pragma GCC unroll 8
          for (int c = 0; c < CHUNKS; ++c) part[t] = _mm512_fmadd_ps(qv[c], load<MASKED>(masks[c], k + c * kLanes), part[t]);
        }
      }
      _mm512_mask_storeu_ps(s + g * stride + j0, lane_mask(length - j0), _mm512_mul_ps(lane_sums(part), _mm512_set1_ps(scale)));
    }
  }
}

// out_h = inverse[h] · Σ_j p_h[j] · v[positions[j]] for HEADS heads at once (each value row loaded once for all),
// folded over j in order per dimension; p_h = p + h · stride, out_h = out + h · d
template <int HEADS, int CHUNKS, bool MASKED>
void weighted_values(const float* p, int64_t stride, const float* values, const int64_t* positions, int64_t length,
                     int64_t d, const float* inverse, float* out) {
  for (int64_t base = 0; base < d; base += CHUNKS * kLanes) {
    __mmask16 masks[CHUNKS];
    __m512 acc[HEADS][CHUNKS];
#pragma GCC unroll 8
    for (int c = 0; c < CHUNKS; ++c) {
      masks[c] = lane_mask(d - base - c * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < HEADS; ++h) acc[h][c] = _mm512_setzero_ps();
    }
    for (int64_t j = 0; j < length; ++j) {
      const float* v = values + positions[j] * d + base;
      __m512 vv[CHUNKS];
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) vv[c] = load<MASKED>(masks[c], v + c * kLanes);
#pragma GCC unroll 4
      for (int h = 0; h < HEADS; ++h) {
        const __m512 ph = _mm512_set1_ps(p[h * stride + j]);
#pragma GCC unroll 8
        for (int c = 0; c < CHUNKS; ++c) acc[h][c] = _mm512_fmadd_ps(ph, vv[c], acc[h][c]);
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < HEADS; ++h) {
      const __m512 inv = _mm512_set1_ps(inverse[h]);
#pragma GCC unroll 8
      for (int c = 0; c < CHUNKS; ++c) _mm512_mask_storeu_ps(out + h * d + base + c * kLanes, masks[c], _mm512_mul_ps(acc[h][c], inv));
    }
  }
}

// p = exp(s − max s) in place over s[0, length); returns 1 / Σ p
float softmax_numerators(float* s, int64_t length) {
  __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < length; j += kLanes) vmax = _mm512_max_ps(vmax, _mm512_mask_loadu_ps(vmax, lane_mask(length - j), s + j));
  const __m512 smax = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < length; j += kLanes) {
    const __mmask16 m = lane_mask(length - j);
    const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + j), smax)));
    _mm512_mask_storeu_ps(s + j, m, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  return 1.0f / _mm512_reduce_add_ps(vsum);
}

constexpr int kHeadsPerPass = 3;  // 3 heads × 8 zmm accumulators + 8 zmm of values: within the 32 zmm

// One (row, KV head): its group of query heads q_g = q + g · d (g < group) over the keys and values at `positions`,
// into out + g · d; scratch holds group × stride scores, inverse group floats
template <int CHUNKS, bool MASKED>
void attend_group(const float* q, const float* keys, const float* values, const int64_t* positions, int64_t length,
                  int64_t d, int64_t group, float scale, float* scratch, int64_t stride, float* inverse, float* out) {
  scores<CHUNKS, MASKED>(q, group, keys, positions, length, d, scale, scratch, stride);
  for (int64_t g = 0; g < group; ++g) inverse[g] = softmax_numerators(scratch + g * stride, length);
  for (int64_t g = 0; g < group; g += kHeadsPerPass) {
    const float* p = scratch + g * stride;
    float* o = out + g * d;
    switch (std::min<int64_t>(kHeadsPerPass, group - g)) {
      case 3: weighted_values<3, CHUNKS, MASKED>(p, stride, values, positions, length, d, inverse + g, o); break;
      case 2: weighted_values<2, CHUNKS, MASKED>(p, stride, values, positions, length, d, inverse + g, o); break;
      default: weighted_values<1, CHUNKS, MASKED>(p, stride, values, positions, length, d, inverse + g, o);
    }
  }
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
  const int64_t group = heads / kv_heads;
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t seen = paths.empty() || paths[i].empty() ? i + 1 : static_cast<int64_t>(paths[i].size());
    if (!paths.empty())
      for (int64_t p : paths[i]) TORCH_CHECK(p >= 0 && p < n, "row attention: path position ", p, " outside the new tokens");
    longest = std::max<int64_t>(longest, cached + seen);
  }
  auto out = torch::empty({n, heads * d}, qkv.options());
  std::vector<float> q(n * heads * d);  // rotated queries
  const float* x = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = keys.data_ptr<float>();
  float* vp = values.data_ptr<float>();
  at::parallel_for(0, n, 4, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* row = x + i * qkv.stride(0);
      rotate(row, cp + i * d, sp + i * d, heads, d, q.data() + i * heads * d);
      for (int64_t h = 0; h < kv_heads; ++h) {
        rotate(row + (heads + h) * d, cp + i * d, sp + i * d, 1, d, kp + h * keys.stride(0) + (cached + i) * d);
        std::memcpy(vp + h * values.stride(0) + (cached + i) * d, row + (heads + kv_heads + h) * d, d * sizeof(float));
      }
    }
  });
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  // whole blocks of dimensions (the usual head sizes) load unmasked
  const auto attend = d == 128 ? &attend_group<8, false> : d == 64 ? &attend_group<4, false> : &attend_group<kChunks, true>;
  at::parallel_for(0, n * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch((longest + kLanes) * group), inverse(group);
    std::vector<int64_t> positions(longest + kLanes, 0);  // zero: padding keys for `scores`
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kvh = item % kv_heads;
      const std::vector<int64_t>* path = paths.empty() || paths[row].empty() ? nullptr : &paths[row];
      const int64_t length = cached + (path ? static_cast<int64_t>(path->size()) : row + 1);
      for (int64_t j = 0; j < length; ++j) positions[j] = j < cached || !path ? j : cached + (*path)[j - cached];
      attend(q.data() + (row * heads + kvh * group) * d, kp + kvh * keys.stride(0), vp + kvh * values.stride(0),
             positions.data(), length, d, group, fscale, scratch.data(), longest + kLanes, inverse.data(),
             op + (row * heads + kvh * group) * d);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("attend", &attend_rows);
}
