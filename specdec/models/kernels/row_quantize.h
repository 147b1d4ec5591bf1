// A float32 activation row quantized to int8 for the AVX-512 VNNI kernels (int8_linear.cpp, int4_linear.cpp): one
// scale a row, s = max|x| / 127, and round(x / s) to nearest even, as torch.round(x / s) and the other int8 kernels,
// so a row is the same bytes whichever kernel reads it. Each kernel lays the bytes out (and sums them) its own way.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace specdec {

// s = max|x| / 127 over a row of k inputs (a zero row: the smallest normal float / 127, never zero)
inline float row_scale(const float* row, int64_t k) {
  __m512 vmax = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + c)));
  float amax = _mm512_reduce_max_ps(vmax);
  for (; c < k; ++c) amax = std::max(amax, std::fabs(row[c]));
  return std::max(amax, std::numeric_limits<float>::min()) / 127.0f;
}

// q = round(row[c] / s) of each of the k inputs, handed on as vector(c, q) for 16 inputs from c (q: their int32
// values, c a multiple of 16) while 16 remain, then as scalar(c, q) one input at a time
template <class Vector, class Scalar>
inline void quantize_row(const float* row, int64_t k, float s, Vector&& vector, Scalar&& scalar) {
  const __m512 vs = _mm512_set1_ps(s);
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) vector(c, _mm512_cvtps_epi32(_mm512_div_ps(_mm512_loadu_ps(row + c), vs)));
  for (; c < k; ++c) scalar(c, static_cast<int32_t>(std::nearbyint(row[c] / s)));
}

}  // namespace specdec
