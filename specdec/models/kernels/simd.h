// Sixteen float lanes, the vector specdec's float32 kernels are written in: one zmm where the build targets AVX-512,
// two ymm (lanes 0–7, 8–15) where it targets AVX2 and FMA. Every operation gives the same bits on either, lane by
// lane (a reduction adds its lanes by one fixed tree), so a kernel built for AVX2 computes bitwise what its AVX-512
// build computes; only the tiles, sized to the registers (32 zmm, or 16 ymm: 8 vectors), differ.
#pragma once
#include <immintrin.h>
#include <cstdint>

namespace specdec::simd {

constexpr int64_t kLanes = 16;

#if defined(__AVX512F__)

constexpr bool kWide = true;  // 32 vector registers
using Vec = __m512;
using Mask = __mmask16;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec broadcast(float x) { return _mm512_set1_ps(x); }
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
// the first `remaining` lanes (all from 16 on, none at 0 or below)
inline Mask lane_mask(int64_t remaining) {
  return remaining >= kLanes ? static_cast<Mask>(0xFFFF)
         : remaining <= 0    ? static_cast<Mask>(0)
                             : static_cast<Mask>((1u << remaining) - 1);
}
inline Vec load(Mask m, const float* p) { return _mm512_maskz_loadu_ps(m, p); }  // zero outside the mask
inline Vec load(Mask m, Vec fallback, const float* p) { return _mm512_mask_loadu_ps(fallback, m, p); }
inline void store(float* p, Mask m, Vec v) { _mm512_mask_storeu_ps(p, m, v); }
inline Vec keep(Mask m, Vec v) { return _mm512_maskz_mov_ps(m, v); }  // zero outside the mask
inline Vec select(Mask m, Vec if_set, Vec otherwise) { return _mm512_mask_blend_ps(m, otherwise, if_set); }
inline Mask non_negative(Vec v) { return _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_GE_OQ); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec abs(Vec a) { return _mm512_abs_ps(a); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }    // a · b + c, one rounding
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); }  // c − a · b, one rounding
inline Vec round_to_integer(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// a · 2^n for integral n ≤ 0, rounded once (to zero below the float range)
inline Vec scale_by_power_of_two(Vec a, Vec n) { return _mm512_scalef_ps(a, n); }
inline __m256 low_half(Vec v) { return _mm512_castps512_ps256(v); }
inline __m256 high_half(Vec v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }
// within each 128-bit quarter, as the x86 instructions of these names
inline Vec unpack_low(Vec a, Vec b) { return _mm512_unpacklo_ps(a, b); }
inline Vec unpack_high(Vec a, Vec b) { return _mm512_unpackhi_ps(a, b); }
template <int kImm>
inline Vec shuffle(Vec a, Vec b) { return _mm512_shuffle_ps(a, b, kImm); }
// quarters (0, 2) of a, then (0, 2) of b; and (1, 3) of each
inline Vec even_quarters(Vec a, Vec b) { return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)); }
inline Vec odd_quarters(Vec a, Vec b) { return _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)); }

#elif defined(__AVX2__) && defined(__FMA__)

constexpr bool kWide = false;  // 16 vector registers
struct Vec {
  __m256 lo, hi;
};
struct Mask {
  __m256i lo, hi;
};

inline Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline Vec broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
inline Mask lane_mask(int64_t remaining) {
  const __m256i count = _mm256_set1_epi32(static_cast<int>(remaining < 0 ? 0 : remaining > kLanes ? kLanes : remaining));
  return {_mm256_cmpgt_epi32(count, _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
          _mm256_cmpgt_epi32(count, _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15))};
}
inline Vec load(Mask m, const float* p) { return {_mm256_maskload_ps(p, m.lo), _mm256_maskload_ps(p + 8, m.hi)}; }
inline Vec load(Mask m, Vec fallback, const float* p) {
  return {_mm256_blendv_ps(fallback.lo, _mm256_maskload_ps(p, m.lo), _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(fallback.hi, _mm256_maskload_ps(p + 8, m.hi), _mm256_castsi256_ps(m.hi))};
}
inline void store(float* p, Mask m, Vec v) { _mm256_maskstore_ps(p, m.lo, v.lo), _mm256_maskstore_ps(p + 8, m.hi, v.hi); }
inline Vec keep(Mask m, Vec v) {
  return {_mm256_and_ps(v.lo, _mm256_castsi256_ps(m.lo)), _mm256_and_ps(v.hi, _mm256_castsi256_ps(m.hi))};
}
inline Vec select(Mask m, Vec if_set, Vec otherwise) {
  return {_mm256_blendv_ps(otherwise.lo, if_set.lo, _mm256_castsi256_ps(m.lo)),
          _mm256_blendv_ps(otherwise.hi, if_set.hi, _mm256_castsi256_ps(m.hi))};
}
inline Mask non_negative(Vec v) {
  return {_mm256_castps_si256(_mm256_cmp_ps(v.lo, _mm256_setzero_ps(), _CMP_GE_OQ)),
          _mm256_castps_si256(_mm256_cmp_ps(v.hi, _mm256_setzero_ps(), _CMP_GE_OQ))};
}
inline Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline Vec sub(Vec a, Vec b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline Vec mul(Vec a, Vec b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline Vec div(Vec a, Vec b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline Vec max(Vec a, Vec b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline Vec abs(Vec a) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, magnitude), _mm256_and_ps(a.hi, magnitude)};
}
inline Vec fmadd(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)}; }
inline Vec round_to_integer(Vec a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
// AVX-512's scalef for integral n in [−216, 0]: 2^n as two normal factors, 2^max(n, −100) (the product with a of
// magnitude ~1 stays exact) and 2^(n − that) (≥ 2^−116), so the result is rounded once, as scalef rounds it
inline __m256 scale_by_power_of_two(__m256 a, __m256 n) {
  const __m256i first = _mm256_max_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(-100));
  const __m256i second = _mm256_sub_epi32(_mm256_cvtps_epi32(n), first);
  const auto power = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(a, power(first)), power(second));
}
inline Vec scale_by_power_of_two(Vec a, Vec n) {
  return {scale_by_power_of_two(a.lo, n.lo), scale_by_power_of_two(a.hi, n.hi)};
}
inline __m256 low_half(Vec v) { return v.lo; }
inline __m256 high_half(Vec v) { return v.hi; }
inline Vec unpack_low(Vec a, Vec b) { return {_mm256_unpacklo_ps(a.lo, b.lo), _mm256_unpacklo_ps(a.hi, b.hi)}; }
inline Vec unpack_high(Vec a, Vec b) { return {_mm256_unpackhi_ps(a.lo, b.lo), _mm256_unpackhi_ps(a.hi, b.hi)}; }
template <int kImm>
inline Vec shuffle(Vec a, Vec b) { return {_mm256_shuffle_ps(a.lo, b.lo, kImm), _mm256_shuffle_ps(a.hi, b.hi, kImm)}; }
inline Vec even_quarters(Vec a, Vec b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, 0x20), _mm256_permute2f128_ps(b.lo, b.hi, 0x20)};
}
inline Vec odd_quarters(Vec a, Vec b) {
  return {_mm256_permute2f128_ps(a.lo, a.hi, 0x31), _mm256_permute2f128_ps(b.lo, b.hi, 0x31)};
}

#else
#error "specdec's float32 kernels are built for AVX-512F, or for AVX2 with FMA"
#endif

// Σ lanes by one tree: the halves lane by lane, then their quarters, then pairs (GCC's _mm512_reduce_add_ps)
inline float reduce_add(Vec v) {
  const __m256 halves = _mm256_add_ps(high_half(v), low_half(v));
  const __m128 quarters = _mm_add_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  const __m128 pairs = _mm_add_ps(quarters, _mm_shuffle_ps(quarters, quarters, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(pairs) + _mm_cvtss_f32(_mm_shuffle_ps(pairs, pairs, _MM_SHUFFLE(1, 1, 1, 1)));
}

inline float reduce_max(Vec v) {  // max is exact: any order gives the same
  const __m256 halves = _mm256_max_ps(high_half(v), low_half(v));
  __m128 m = _mm_max_ps(_mm256_extractf128_ps(halves, 1), _mm256_castps256_ps128(halves));
  m = _mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_max_ps(m, _mm_shuffle_ps(m, m, _MM_SHUFFLE(2, 3, 0, 1))));
}

// exp(x) for x ≤ 0 (attention scores less their maximum; −|x| for a sigmoid): 2^n · e^r, r = x − n · ln 2 in
// [−ln 2 / 2, ln 2 / 2], e^r by Cephes' degree-7 polynomial (≤ 2 ulp); below the float range 2^n takes it to 0
inline Vec exp_nonpositive(Vec x) {
  x = max(x, broadcast(-150.0f));
  const Vec n = round_to_integer(mul(x, broadcast(1.44269504088896341f)));
  Vec r = fnmadd(n, broadcast(0.693359375f), x);
  r = fnmadd(n, broadcast(-2.12194440e-4f), r);
  Vec p = broadcast(1.9875691500e-4f);
  p = fmadd(p, r, broadcast(1.3981999507e-3f));
  p = fmadd(p, r, broadcast(8.3334519073e-3f));
  p = fmadd(p, r, broadcast(4.1665795894e-2f));
  p = fmadd(p, r, broadcast(1.6666665459e-1f));
  p = fmadd(p, r, broadcast(5.0000001201e-1f));
  p = fmadd(mul(p, r), r, add(r, broadcast(1.0f)));
  return scale_by_power_of_two(p, n);
}

// silu(gate) · up, silu(g) = g · σ(g), σ from e = exp(−|g|) ≤ 1: 1 / (1 + e) for g ≥ 0, e / (1 + e) below (no
// overflow either side). norm_swiglu.cpp's SwiGLU and int8_linear.cpp's fused epilogue both take it: the same bits.
inline Vec swiglu(Vec gate, Vec up) {
  const Vec one = broadcast(1.0f);
  const Vec e = exp_nonpositive(sub(zero(), abs(gate)));
  const Vec sigmoid = div(select(non_negative(gate), one, e), add(one, e));
  return mul(mul(gate, sigmoid), up);
}

}  // namespace specdec::simd
