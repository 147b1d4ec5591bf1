// Vector math shared by specdec's AVX-512 kernels.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace specdec {

constexpr int64_t kLanes = 16;  // floats per zmm

// the first `remaining` of a zmm's lanes (all of them from 16 on, none at 0 or below)
inline __mmask16 lane_mask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<__mmask16>(0xFFFF)
         : remaining <= 0    ? static_cast<__mmask16>(0)
                             : static_cast<__mmask16>((1u << remaining) - 1);
}

// exp(x) for x ≤ 0 (attention scores less their maximum; −|x| for a sigmoid): 2^n · e^r, r = x − n · ln 2 in
// [−ln 2 / 2, ln 2 / 2], e^r by Cephes' degree-7 polynomial (≤ 2 ulp); scalef takes 2^n down to 0 below the float
// range
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-150.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

}  // namespace specdec
