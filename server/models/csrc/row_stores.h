// A register tile's rows of fp32 sums into y, the columns past a ragged last panel's end left alone: shared by the
// panel GEMMs (csrc/small_gemm.cpp, csrc/int8_gemm.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace neuronmm {

#if defined(__AVX512F__)
// The first n of 16 lanes.
inline __mmask16 first_lanes(int64_t n) {
  return n <= 0 ? __mmask16(0) : n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// 32 sums (columns 0-15 and 16-31) into y, or the first `valid` of them.
inline void store_row(float* y, __m512 lo, __m512 hi, int64_t valid) {
  _mm512_mask_storeu_ps(y, first_lanes(valid), lo);
  _mm512_mask_storeu_ps(y + 16, first_lanes(valid - 16), hi);
}
#endif

#if defined(__AVX512BF16__)
// 32 sums into y, each rounded once to bf16, or the first `valid` of them.
inline void store_row(at::BFloat16* y, __m512 lo, __m512 hi, int64_t valid) {
  const __m256i a = (__m256i)_mm512_cvtneps_pbh(lo), b = (__m256i)_mm512_cvtneps_pbh(hi);
  if (valid >= 32) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), a);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + 16), b);
    return;
  }
  _mm256_mask_storeu_epi16(y, first_lanes(valid), a);
  _mm256_mask_storeu_epi16(y + 16, first_lanes(valid - 16), b);
}
#endif

#if defined(__AVX2__)
// 8 sums into y, or the first `valid` of them.
inline void store8(float* y, __m256 v, int64_t valid) {
  if (valid >= 8)
    _mm256_storeu_ps(y, v);
  else if (valid > 0)
    _mm256_maskstore_ps(y, _mm256_cmpgt_epi32(_mm256_set1_epi32(int(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)),
                        v);
}
#endif

}  // namespace neuronmm
