// Eight fp32 lanes (AVX2 + FMA, so every x86-64-v3 CPU and every AVX-512 one): a cached key or value row widened to
// fp32, and exp. Shared by attention's AVX2 loops, the sampler's and SiLU's AVX2 loops (fused_ops.cpp) and the
// prefill tiles (prefill_attention.cpp), which run in the AVX-512 build too.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <immintrin.h>

namespace neuronmm::vec8 {

// 8 cache values widened to fp32: an fp32 cache as it is, bf16 by a shift, fp16 by F16C (every AVX2 CPU has it).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
#if defined(__F16C__)
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// fp8 e4m3fn as the AVX-512 load16 widens it: moved into an fp16's places, then times 2^8
inline __m256 load8(const c10::Float8_e4m3fn* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i h = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
}
#endif

// fused_ops.cpp's scalar fast_exp on 8 lanes: the same operations in the same order (no FMA contraction), so the
// same bits.
inline __m256 fast_exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_sub_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(1.428606765330187e-06f)));
  __m256 p = _mm256_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm256_add_ps(_mm256_set1_ps(c), _mm256_mul_ps(r, p));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

}  // namespace neuronmm::vec8
#endif
