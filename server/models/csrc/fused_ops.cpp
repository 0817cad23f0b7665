// CPU kernels for the decode step's small ops, registered as torch ops in the `neuronmm` namespace.
//
// Why: at decode sizes a Llama layer is four GEMMs plus ~25 small ops (norms, rotary, cache writes,
// attention, activation); from Python each small op costs more in dispatch than in arithmetic. These
// kernels fold them into three calls per layer and keep HF's rounding points (every intermediate the
// reference rounds to the model dtype is rounded here too), so greedy outputs match HF in bf16 as in fp32.
//
// Layouts: the KV cache of one layer is [num_blocks, num_kv_heads, block_size, head_dim]; a token's
// cache slot is block * block_size + offset. A slot-per-sequence cache is the case block_size = max_len.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "prefill_attention.h"
#include "step_ops.h"
#include "vec8.h"
#include "work_split.h"

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// always_inline: GCC takes a function that only prefetches for one without effects (IPA pure-const) and, where it
// did not inline it first, deletes the calls; the x86-64-v3 build lost every attention prefetch that way.
#define NEURONMM_PREFETCH_FN __attribute__((always_inline)) inline

inline float load_f(float v) { return v; }
inline float load_f(c10::BFloat16 v) {
  // bf16 -> fp32 is a shift; written out so the compiler vectorises the loops that use it
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float load_f(c10::Half v) { return static_cast<float>(v); }
// fp8 by a table of its 256 values (c10's conversion is bit work per value; the attention's scalar tails read
// a few positions of every sequence through it)
inline float load_f(c10::Float8_e4m3fn v) {
  static const std::array<float, 256> values = [] {
    std::array<float, 256> table{};
    for (int code = 0; code < 256; ++code) table[code] = static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
    return table;
  }();
  return values[v.x];
}

// A value as the cache stores it. fp8 (e4m3fn, `engine.kv_cache_dtype: fp8`) saturates at its largest finite value,
// +-448, as torch's cast does; clamped here so that does not rest on the c10 version's conversion past 448.
template <typename C>
inline C to_cache(float v) {
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) v = std::min(std::max(v, -448.f), 448.f);
  return static_cast<C>(v);
}

// n floats as to_cache<Float8_e4m3fn> stores them (the same bits), 16 or 8 at a time: c10's conversion is scalar bit
// work, ~0.6 ms of a batch-16 step's cache writes. |x| >= 2^-6 rounds to nearest even at its mantissa's 3rd bit and
// rebiases the exponent (127 -> 7); below, the value is m * 2^-9 with m = |x| * 2^9 rounded to nearest even (m = 8 is
// the smallest normal's code). NaN stays NaN (0x7F with its sign).
inline void store_fp8(const float* src, int64_t n, c10::Float8_e4m3fn* dst) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i sign = _mm512_srli_epi32(_mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN)), 24);
    const __m512 a = _mm512_min_ps(_mm512_set1_ps(448.f), _mm512_abs_ps(x));  // NaN passes (min returns its 2nd)
    const __m512i ab = _mm512_castps_si512(a);
    const __m512i rounded = _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32(0x7FFFF),
                                                                  _mm512_and_si512(_mm512_srli_epi32(ab, 20), _mm512_set1_epi32(1))));
    const __m512i normal = _mm512_sub_epi32(_mm512_srli_epi32(rounded, 20), _mm512_set1_epi32(120 << 3));
    const __m512i tiny = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(512.f)));
    __m512i code = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(a, _mm512_set1_ps(0.015625f), _CMP_LT_OQ), normal, tiny);
    code = _mm512_mask_mov_epi32(code, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7F));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(src + i);
    const __m256i bits = _mm256_castps_si256(x);
    const __m256i sign = _mm256_srli_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(INT32_MIN)), 24);
    const __m256 a = _mm256_min_ps(_mm256_set1_ps(448.f),
                                   _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32(INT32_MAX))));
    const __m256i ab = _mm256_castps_si256(a);
    const __m256i rounded = _mm256_add_epi32(ab, _mm256_add_epi32(_mm256_set1_epi32(0x7FFFF),
                                                                  _mm256_and_si256(_mm256_srli_epi32(ab, 20), _mm256_set1_epi32(1))));
    const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(rounded, 20), _mm256_set1_epi32(120 << 3));
    const __m256i tiny = _mm256_cvtps_epi32(_mm256_mul_ps(a, _mm256_set1_ps(512.f)));
    __m256i code = _mm256_blendv_epi8(normal, tiny, _mm256_castps_si256(_mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ)));
    code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7F), _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    code = _mm256_or_si256(code, sign);
    const __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(code), _mm256_extracti128_si256(code, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + i), _mm_packus_epi16(words, words));
  }
#endif
  for (; i < n; ++i) dst[i] = to_cache<c10::Float8_e4m3fn>(src[i]);
}

// n floats as to_cache<C> stores them: fp8 and fp16 a vector at a time (fp16 by F16C, the same round-to-nearest-even
// as c10's conversion, which is a call per value: 16 tokens' writes under an fp32 model took 9.7 µs a layer with an
// fp16 cache, 8.5 with an fp32 one; 8.3 with this).
template <typename C>
inline void store_cache_row(const float* src, int64_t n, C* dst) {
  if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
    return store_fp8(src, n, dst);
  } else {
    int64_t i = 0;
#if defined(__F16C__)
    if constexpr (std::is_same_v<C, c10::Half>) {
      constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtps_ph(_mm512_loadu_ps(src + i), kRound));
#endif
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), kRound));
    }
#endif
    for (; i < n; ++i) dst[i] = to_cache<C>(src[i]);
  }
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
// fp8 e4m3fn -> fp32 exactly: its sign and low 7 bits, moved into an fp16's places (sign 15, exponent from 10), are an
// fp16 of the same mantissa whose exponent bias is 8 short (15 against 7), subnormals included; times 2^8 is the value.
// Sign-extended and shifted left 7, the byte's sign lands on bits 15 and 14: the mask clears 14 (0xBF80).
inline __m512 load16(const c10::Float8_e4m3fn* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
template <typename T>
inline float dot_head_avx512(const float* q, const T* k, int64_t d) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + i), load16(k + i), acc);
  return _mm512_reduce_add_ps(acc);
}
template <typename T>
inline void axpy_head_avx512(float p, const T* v, float* acc, int64_t d) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t i = 0; i < d; i += 16)
    _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(pv, load16(v + i), _mm512_loadu_ps(acc + i)));
}
// caches whose heads of a multiple of 16 go through the loops above (an fp16 cache's stay scalar)
template <typename T>
constexpr bool kHeadAvx512 =
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Float8_e4m3fn>;
#endif

// q·k and acc += p·v over one head (fp32 q and acc, k and v in the cache dtype). Written with AVX-512
// where the CPU has it (the compiler does not vectorise the bf16 widening in these loops by itself).
template <typename T>
inline float dot_head(const float* q, const T* k, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (kHeadAvx512<T>) {
    if (d % 16 == 0) return dot_head_avx512(q, k, d);
  }
#endif
  float dot = 0.f;
  for (int64_t i = 0; i < d; ++i) dot += q[i] * load_f(k[i]);
  return dot;
}
template <typename T>
inline void axpy_head(float p, const T* v, float* acc, int64_t d) {
#if defined(__AVX512F__)
  if constexpr (kHeadAvx512<T>) {
    if (d % 16 == 0) return axpy_head_avx512(p, v, acc, d);
  }
#endif
  for (int64_t i = 0; i < d; ++i) acc[i] += p * load_f(v[i]);
}

#if defined(__AVX512F__)
// Attention over a block of the cache (fp32, bf16 or fp16) with the running sums in registers. One query head
// against 16 keys ends in 16 horizontal sums; a transpose-add tree does them together (45 shuffles and adds instead of
// 16 full reductions). Values: the accumulators of up to 16 / D16 query heads stay in registers across a
// block's keys, each value row widened once for the whole group (a store-to-load chain through memory per
// key made the old axpy loop latency-bound). D16 = head_dim / 16.
template <typename T>
constexpr bool kVectorAttention = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> ||
                                   std::is_same_v<T, c10::Half> || std::is_same_v<T, c10::Float8_e4m3fn>;

// lane i of the result: the sum of v[i]'s lanes
inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44), _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * i], u[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x88), _mm512_shuffle_f32x4(w[0], w[1], 0xDD));
}

// Prefetches the cache lines of one key or value row of `ahead` (row j), if any, into L2: called once per row
// consumed, so a block kPrefetchBlocks ahead arrives a row at a time. Fetching a whole block in one burst did not
// help (it stalls on the core's few line-fill buffers); spread over the rows, it took a cold batch-16 layer at 150
// positions from ~162 to ~135 µs, and a batch-16 decode step at 1,000 positions from 49.9 to 43.9 ms. Into L2
// rather than L1 (a line on its way to L1 holds a fill buffer until it lands), and the rows shared among a group's
// query heads (RowShare). Both, decode steps alternating with the old prefetch in one process: batch 16 at 128-288
// positions 1.02-1.04 x natively (bf16 cache), 1.05 x at batch 32, 1.07 x at 1,000 positions; fp32 caches 1.05 x
// (AVX-512) and 1.03 x (AVX2); batch 1 and fp16 caches unchanged.
template <typename T, int D16>
NEURONMM_PREFETCH_FN void prefetch_row(const T* ahead, int64_t j) {
  if (ahead == nullptr) return;
  const char* row = reinterpret_cast<const char*>(ahead + j * D16 * 16);
  for (int64_t off = 0; off < D16 * 16 * int64_t(sizeof(T)); off += 64) _mm_prefetch(row + off, _MM_HINT_T1);
}
#endif

// The rows of the block ahead that one query head's pass over a block prefetches: first, first + every, ... The
// heads of a group read the same keys one after another; when the first fetched the whole block ahead, its
// prefetches came in one burst, 1 / group of the block's work. Held as a bit per row (a pass reads at most 16 rows):
// `row % every` in the score loops was a 64-bit division per key row and query head.
struct RowShare {
  uint32_t rows = ~0u;  // bit j: row j is this head's to prefetch (default: every row)
  RowShare() = default;
  RowShare(int first, int every) : rows(0) {
    for (int j = first; j < 32; j += std::max(every, 1)) rows |= 1u << j;
  }
  bool has(int64_t row) const { return (rows >> row) & 1u; }
};

#if defined(__AVX512F__)
// q (fp32, D16 * 16) against 16 consecutive keys of one head: their 16 scores
template <typename T, int D16>
inline __m512 dot16_keys(const float* q, const T* k, const T* ahead = nullptr, RowShare share = {}) {
  __m512 qv[D16], dots[16];
  for (int d = 0; d < D16; ++d) qv[d] = _mm512_loadu_ps(q + 16 * d);
  for (int j = 0; j < 16; ++j) {
    if (share.has(j)) prefetch_row<T, D16>(ahead, j);
    const T* kj = k + j * D16 * 16;
    __m512 a = _mm512_mul_ps(qv[0], load16(kj));
    for (int d = 1; d < D16; ++d) a = _mm512_fmadd_ps(qv[d], load16(kj + 16 * d), a);
    dots[j] = a;
  }
  return hsum16(dots);
}

#if defined(__AVX512BF16__)
// The same for a bf16 cache with VDPBF16PS: the bf16 query (unscaled) against the keys as they are stored,
// two products per lane and instruction, no widening; the scale is applied to the 16 sums. D32 = head_dim / 32.
template <int D32>
inline __m512 dot16_keys_bf16(const c10::BFloat16* q, const c10::BFloat16* k, __m512 scale,
                              const c10::BFloat16* ahead = nullptr, RowShare share = {}) {
  __m512bh qv[D32];
  __m512 dots[16];
  for (int d = 0; d < D32; ++d) qv[d] = (__m512bh)_mm512_loadu_si512(q + 32 * d);
  for (int j = 0; j < 16; ++j) {
    if (share.has(j)) prefetch_row<c10::BFloat16, 2 * D32>(ahead, j);
    __m512 a = _mm512_setzero_ps();
    for (int d = 0; d < D32; ++d) a = _mm512_dpbf16_ps(a, qv[d], (__m512bh)_mm512_loadu_si512(k + (j * D32 + d) * 32));
    dots[j] = a;
  }
  return _mm512_mul_ps(hsum16(dots), scale);
}
#endif

// An fp8 cache's 16 keys of one head widened once for all the query heads that share them (dot16_keys widens per
// head: three times the conversions under SmolLM2's groups, which made the smaller cache the slower one): to fp32, or to
// bf16 (exact: every e4m3 value is one) for VDPBF16PS under a bf16 model. Prefetches `ahead` as dot16_keys does.
template <int D16>
inline void widen16_keys(const c10::Float8_e4m3fn* k, float* dst, const c10::Float8_e4m3fn* ahead) {
  for (int j = 0; j < 16; ++j) {
    prefetch_row<c10::Float8_e4m3fn, D16>(ahead, j);
    for (int d = 0; d < D16; ++d) _mm512_storeu_ps(dst + (j * D16 + d) * 16, load16(k + (j * D16 + d) * 16));
  }
}
#if defined(__AVX512BF16__)
template <int D16>
inline void widen16_keys(const c10::Float8_e4m3fn* k, c10::BFloat16* dst, const c10::Float8_e4m3fn* ahead) {
  for (int j = 0; j < 16; ++j) {
    prefetch_row<c10::Float8_e4m3fn, D16>(ahead, j);
    for (int d = 0; d < D16; d += 2) {  // cvtne2ps_pbh: its second operand fills the low half
      const __m512bh pair = _mm512_cvtne2ps_pbh(load16(k + (j * D16 + d + 1) * 16), load16(k + (j * D16 + d) * 16));
      _mm512_storeu_si512(dst + (j * D16 + d) * 16, (__m512i)pair);
    }
  }
}
#endif

// acc[h] += sum_j p[h * stride + j] * v[j] for NH query heads over `len` value rows
template <typename T, int D16, int NH>
inline void pv_heads(const float* p, int64_t stride, const T* v, int64_t len, float* acc, const T* ahead) {
  __m512 a[NH][D16];
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < D16; ++d) a[h][d] = _mm512_loadu_ps(acc + (h * D16 + d) * 16);
  for (int64_t j = 0; j < len; ++j) {
    __m512 vv[D16];
    prefetch_row<T, D16>(ahead, j);
    for (int d = 0; d < D16; ++d) vv[d] = load16(v + j * D16 * 16 + 16 * d);
    for (int h = 0; h < NH; ++h) {
      const __m512 pb = _mm512_set1_ps(p[h * stride + j]);
      for (int d = 0; d < D16; ++d) a[h][d] = _mm512_fmadd_ps(pb, vv[d], a[h][d]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int d = 0; d < D16; ++d) _mm512_storeu_ps(acc + (h * D16 + d) * 16, a[h][d]);
}

template <typename T, int D16>
inline void pv_group(const float* p, int64_t stride, const T* v, int64_t len, float* acc, int64_t num_heads,
                     const T* ahead) {
  constexpr int64_t kMaxHeads = 16 / D16;  // 16 accumulators + D16 value registers of the 32
  for (int64_t h0 = 0; h0 < num_heads; h0 += kMaxHeads) {
    const float* ph = p + h0 * stride;
    float* ah = acc + h0 * D16 * 16;
    switch (std::min(kMaxHeads, num_heads - h0)) {
      case 1: pv_heads<T, D16, 1>(ph, stride, v, len, ah, h0 == 0 ? ahead : nullptr); break;
      case 2: pv_heads<T, D16, 2>(ph, stride, v, len, ah, h0 == 0 ? ahead : nullptr); break;
      case 3: pv_heads<T, D16, 3>(ph, stride, v, len, ah, h0 == 0 ? ahead : nullptr); break;
      default: pv_heads<T, D16, 4>(ph, stride, v, len, ah, h0 == 0 ? ahead : nullptr); break;
    }
  }
}
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 (no AVX-512): attention's dot products and value sums 8 lanes at a time. The compiler keeps the scalar loops
// scalar (reordering a float sum needs -ffast-math), and they were a quarter of a batch-16 decode step.
inline float hsum8(__m256 v) {
  const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}
using neuronmm::vec8::load8;
template <typename C>
constexpr bool kAvx2Attention = std::is_same_v<C, float> || std::is_same_v<C, c10::BFloat16>
#if defined(__F16C__)
                                || std::is_same_v<C, c10::Half> || std::is_same_v<C, c10::Float8_e4m3fn>
#endif
    ;

// A head's dot product and value sum 8 lanes at a time, for every cache dtype (load8 widens a narrow one). The
// vector loops below take runs of 8 keys of 64-wide heads (and of 128-wide ones in groups of 2-4); every other key
// comes here, where a scalar loop once widened one value at a time: over 128-wide heads (Qwen3-0.6B's shape: 28
// layers, 8 KV heads, 16 rows at 192 positions) a step's attention took 100 ms over an fp16 cache, 23 over fp32.
template <typename T>
inline float dot_head_avx2(const float* q, const T* k, int64_t d) {
  if (d % 16 != 0) {
    float dot = 0.f;
    for (int64_t i = 0; i < d; ++i) dot += q[i] * load_f(k[i]);
    return dot;
  }
  __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();  // two chains: the FMA latency, not the ports, binds
  for (int64_t i = 0; i < d; i += 16) {
    a = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), load8(k + i), a);
    b = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), load8(k + i + 8), b);
  }
  return hsum8(_mm256_add_ps(a, b));
}
template <typename T>
inline void axpy_head_avx2(float p, const T* v, float* acc, int64_t d) {
  if (d % 8 != 0) {
    for (int64_t i = 0; i < d; ++i) acc[i] += p * load_f(v[i]);
    return;
  }
  const __m256 pv = _mm256_set1_ps(p);
  for (int64_t i = 0; i < d; i += 8)
    _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, load8(v + i), _mm256_loadu_ps(acc + i)));
}
template <>
inline float dot_head(const float* q, const float* k, int64_t d) { return dot_head_avx2(q, k, d); }
template <>
inline void axpy_head(float p, const float* v, float* acc, int64_t d) { axpy_head_avx2(p, v, acc, d); }
template <>
inline float dot_head(const float* q, const c10::BFloat16* k, int64_t d) { return dot_head_avx2(q, k, d); }
template <>
inline void axpy_head(float p, const c10::BFloat16* v, float* acc, int64_t d) { axpy_head_avx2(p, v, acc, d); }
#if defined(__F16C__)
template <>
inline float dot_head(const float* q, const c10::Half* k, int64_t d) { return dot_head_avx2(q, k, d); }
template <>
inline void axpy_head(float p, const c10::Half* v, float* acc, int64_t d) { axpy_head_avx2(p, v, acc, d); }
template <>
inline float dot_head(const float* q, const c10::Float8_e4m3fn* k, int64_t d) { return dot_head_avx2(q, k, d); }
template <>
inline void axpy_head(float p, const c10::Float8_e4m3fn* v, float* acc, int64_t d) { axpy_head_avx2(p, v, acc, d); }
#endif

// The cache lines of row j of a 64-wide head `kPrefetchBlocks` blocks ahead (nullptr: none), fetched into L2 a row
// per row consumed, as prefetch_row does for the AVX-512 loops: paged blocks are 4 KB apart at best, where the
// hardware prefetcher stops.
template <typename C>
NEURONMM_PREFETCH_FN void prefetch_row64(const C* ahead, int64_t j) {
  if (ahead == nullptr) return;
  for (int64_t off = 0; off < 64 * int64_t(sizeof(C)); off += 64)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + j * 64) + off, _MM_HINT_T1);
}

// q · k for 8 consecutive keys of one 64-wide head: 8 sums in registers, reduced together by a transpose-add
// (three rounds of horizontal adds and a lane swap instead of 8 separate horizontal sums).
template <typename C>
inline __m256 dot8_keys64_avx2(const float* q, const C* k, const C* ahead, RowShare share = {}) {
  for (int j = 0; j < 8; ++j)
    if (share.has(j)) prefetch_row64(ahead, j);
  __m256 s[8];
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) s[j] = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) {
    const __m256 qc = _mm256_loadu_ps(q + 8 * c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) s[j] = _mm256_fmadd_ps(qc, load8(k + j * 64 + 8 * c), s[j]);
  }
  // lane j of u0 (j < 4) and u1 (j - 4): key j's sum over one 128-bit half; the halves are added last
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(s[0], s[1]), _mm256_hadd_ps(s[2], s[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(s[4], s[5]), _mm256_hadd_ps(s[6], s[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Caches whose rows the AVX2 loops widen once for a group's query heads rather than once per head: fp8, whose
// conversion takes five instructions. An fp16 cache's vcvtph2ps reads its operand from memory, and widening it once
// was slower (a batch-16 AVX2 step at 768 positions).
template <typename C>
constexpr bool kWidenOnce = std::is_same_v<C, c10::Float8_e4m3fn>;

// `rows` rows of a 64-wide head widened to fp32 into `dst`, prefetching `ahead` a row per row.
template <typename C>
inline void widen_rows64(const C* k, int64_t rows, float* dst, const C* ahead) {
  for (int64_t j = 0; j < rows; ++j) {
    prefetch_row64(ahead, j);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(dst + j * 64 + 8 * c, load8(k + j * 64 + 8 * c));
  }
}

// acc += sum_j p[j] * v[j] over `len` value rows of one 64-wide head, the sums in 8 registers for the whole run
// (axpy_head per row stores and reloads them: a store-to-load chain per row).
template <typename C>
inline void pv_head64_avx2(const float* p, const C* v, int64_t len, float* acc, const C* ahead) {
  __m256 a[8];
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + 8 * c);
  for (int64_t j = 0; j < len; ++j) {
    prefetch_row64(ahead, j);
    const __m256 pj = _mm256_broadcast_ss(p + j);
#pragma GCC unroll 8
    for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pj, load8(v + j * 64 + 8 * c), a[c]);
  }
#pragma GCC unroll 8
  for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + 8 * c, a[c]);
}

// The G query heads that share a 64-wide KV head, over the same keys and values at once. The per-head loops above
// widen (fp16, bf16) or load each cached row once per query head: G times a row. Here each row is widened once for
// the whole group: cache-resident, a 16-token step's attention ran 1.28 x faster; streamed, where each core's draw
// from memory holds it, 5-9 %. Every sum is the same FMA chain, reduced the same way, as the per-head loops', so the
// scores and outputs keep their bits.
// Keys a call: as many as keep G x KEYS sums, the G query chunks and a key chunk in the 16 registers.
template <int G>
constexpr int kGroupKeys = G <= 3 ? 4 : 2;

// q · k for kGroupKeys<G> consecutive keys and each of the group's G query heads (q: G heads of D, one after
// another); head g's scores go to scores[g * n ...]. Each key's sum: one FMA chain over the head's 8-lane chunks,
// reduced as dot8_keys64_avx2 reduces it (for D = 64 its very chain).
template <int D, int G, typename C>
inline void dot_keys_group_avx2(const float* q, const C* k, const C* ahead, float* scores, int64_t n) {
  constexpr int K = kGroupKeys<G>;
  for (int j = 0; j < K; ++j)
    for (int r = 0; r < D / 64; ++r) prefetch_row64(ahead ? ahead + r * 64 : nullptr, j * (D / 64));
  __m256 s[G][K];
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < K; ++j) s[g][j] = _mm256_setzero_ps();
#pragma GCC unroll 16
  for (int c = 0; c < D / 8; ++c) {
    __m256 qc[G];
#pragma GCC unroll 4
    for (int g = 0; g < G; ++g) qc[g] = _mm256_loadu_ps(q + g * D + 8 * c);
#pragma GCC unroll 4
    for (int j = 0; j < K; ++j) {
      const __m256 kc = load8(k + j * D + 8 * c);
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) s[g][j] = _mm256_fmadd_ps(qc[g], kc, s[g][j]);
    }
  }
#pragma GCC unroll 4
  for (int g = 0; g < G; ++g) {
    // lanes 0-3: each key's sum over the low 128 bits, lanes 4-7 over the high; the halves added last
    const __m256 h01 = _mm256_hadd_ps(s[g][0], s[g][1]);
    __m256 u;
    if constexpr (K == 4) u = _mm256_hadd_ps(h01, _mm256_hadd_ps(s[g][2], s[g][3]));
    else u = _mm256_hadd_ps(h01, h01);
    const __m128 r = _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
    if constexpr (K == 4) _mm_storeu_ps(scores + g * n, r);
    else _mm_storel_pi(reinterpret_cast<__m64*>(scores + g * n), r);
  }
}

// acc_g += sum_j p_g[j] * v[j] over `len` value rows for each of the group's G query heads (p: head g's weights at
// p[g * n ...], acc: G heads of D), in passes over a part of the D lanes (G x its chunks sums in registers). Each
// lane's sum: pv_head64_avx2's chain, rows in order.
template <int D, int G, typename C>
inline void pv_rows_group_avx2(const float* p, int64_t n, const C* v, int64_t len, float* acc, const C* ahead) {
  constexpr int CH = G <= 3 ? 4 : 2;  // 8-lane chunks a pass
  for (int c0 = 0; c0 < D / 8; c0 += CH) {
    __m256 a[G][CH];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + 8 * (c0 + c));
    for (int64_t j = 0; j < len; ++j) {
      if (c0 == 0)
        for (int r = 0; r < D / 64; ++r) prefetch_row64(ahead ? ahead + r * 64 : nullptr, j * (D / 64));
      __m256 pj[G];
#pragma GCC unroll 4
      for (int g = 0; g < G; ++g) pj[g] = _mm256_broadcast_ss(p + g * n + j);
#pragma GCC unroll 4
      for (int c = 0; c < CH; ++c) {
        const __m256 vc = load8(v + j * D + 8 * (c0 + c));
#pragma GCC unroll 4
        for (int g = 0; g < G; ++g) a[g][c] = _mm256_fmadd_ps(pj[g], vc, a[g][c]);
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < CH; ++c) _mm256_storeu_ps(acc + g * D + 8 * (c0 + c), a[g][c]);
  }
}

// The grouped loops for a group of `group` query heads of width D: 8 keys' scores (false: no grouped loop for this
// group)...
template <int D, typename C>
inline bool dot8_keys_group_avx2(int64_t group, const float* q, const C* k, const C* ahead, float* scores,
                                 int64_t n) {
  const auto run = [&](auto g) {
    constexpr int G = decltype(g)::value, K = kGroupKeys<G>;
    for (int j = 0; j < 8; j += K)
      dot_keys_group_avx2<D, G>(q, k + j * D, ahead ? ahead + j * D : nullptr, scores + j, n);
    return true;
  };
  switch (group) {
    case 2: return run(std::integral_constant<int, 2>{});
    case 3: return run(std::integral_constant<int, 3>{});
    case 4: return run(std::integral_constant<int, 4>{});
    default: return false;
  }
}

// 128-wide heads take the grouped loops over a cache they widen (bf16, fp16, fp8: a 16-row step's attention 1.2-1.3 x
// faster); over an fp32 cache the per-key loops stayed faster (22-24 against 25-29 ms, Qwen3-0.6B's shape).
template <typename C>
constexpr bool kWidens128 = !std::is_same_v<C, float>;

// ... and `len` value rows into the group's sums.
template <int D, typename C>
inline bool pv_group_avx2(int64_t group, const float* p, int64_t n, const C* v, int64_t len, float* acc,
                          const C* ahead) {
  switch (group) {
    case 2: pv_rows_group_avx2<D, 2>(p, n, v, len, acc, ahead); return true;
    case 3: pv_rows_group_avx2<D, 3>(p, n, v, len, acc, ahead); return true;
    case 4: pv_rows_group_avx2<D, 4>(p, n, v, len, acc, ahead); return true;
    default: return false;
  }
}
#endif

// exp with 1e-7 relative error from arithmetic only, so loops over it vectorise (std::exp does not):
// x = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2), exp(r) by its degree-6 Taylor polynomial.
inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.f), 88.f);
  const float n = std::rint(x * 1.44269504f);
  const float r = (x - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (1.f / 6 + r * (1.f / 24 + r * (1.f / 120 + r * (1.f / 720))))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
// fast_exp on 16 lanes, the same operations in the same order (no FMA contraction), so the same bits.
inline __m512 fast_exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_sub_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693145751953125f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(1.428606765330187e-06f)));
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_add_ps(_mm512_set1_ps(c), _mm512_mul_ps(r, p));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#elif defined(__AVX2__)
using neuronmm::vec8::fast_exp8;
#endif

// The largest logit of a row (-inf for an empty or fully masked row).
inline float row_max(const float* x, int64_t n) {
  float max_x = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + i));
  max_x = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(-INFINITY);
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (const float v : lanes) max_x = std::max(max_x, v);
#endif
  for (; i < n; ++i) max_x = std::max(max_x, x[i]);
  return max_x;
}

// probs[lo, hi) = exp((logits - max_x) * inv_t), a masked (-inf) logit 0 exactly (fast_exp clamps its input,
// so it would give 1e-38); returns their sum. The sampler's blocks, and attention's softmax in place (inv_t 1).
// Lanes give fast_exp's bits (an omp simd loop over fast_exp stayed scalar: ~30 % of the AVX2 attention).
inline float exp_block(const float* logits, float* probs, int64_t lo, int64_t hi, float max_x, float inv_t) {
  float sum = 0.f;
  int64_t i = lo;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max_x), vt = _mm512_set1_ps(inv_t), ninf = _mm512_set1_ps(-INFINITY);
  __m512 vsum = _mm512_setzero_ps();
  for (; i + 16 <= hi; i += 16) {
    const __m512 x = _mm512_loadu_ps(logits + i);
    const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(live, fast_exp16(_mm512_mul_ps(_mm512_sub_ps(x, vmax), vt)));
    _mm512_storeu_ps(probs + i, e);
    vsum = _mm512_add_ps(vsum, e);
  }
  sum = _mm512_reduce_add_ps(vsum);
#elif defined(__AVX2__)
  const __m256 vmax = _mm256_set1_ps(max_x), vt = _mm256_set1_ps(inv_t), ninf = _mm256_set1_ps(-INFINITY);
  __m256 vsum = _mm256_setzero_ps();
  for (; i + 8 <= hi; i += 8) {
    const __m256 x = _mm256_loadu_ps(logits + i);
    const __m256 live = _mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ);
    const __m256 e = _mm256_and_ps(live, fast_exp8(_mm256_mul_ps(_mm256_sub_ps(x, vmax), vt)));
    _mm256_storeu_ps(probs + i, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vsum);
  for (const float v : lanes) sum += v;
#endif
  for (; i < hi; ++i) {
    probs[i] = logits[i] == -INFINITY ? 0.f : fast_exp((logits[i] - max_x) * inv_t);
    sum += probs[i];
  }
  return sum;
}

// Round a float to T and back: the value the reference holds after an op in dtype T.
template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }
template <>
inline float round_to<float>(float v) { return v; }

// ---- rms_norm / add_rms_norm ---------------------------------------------------------------------
// A norm's weight in x's dtype, contiguous: as it is when it already is (a step makes 60 norm calls; `to` and
// `contiguous` each go through the dispatcher even when they return their input).
inline at::Tensor as_dtype_of(const at::Tensor& weight, const at::Tensor& x) {
  if (weight.scalar_type() == x.scalar_type() && weight.is_contiguous()) return weight;
  return weight.to(x.scalar_type()).contiguous();
}

// HF LlamaRMSNorm: y = weight * to_dtype(x_f32 * rsqrt(mean(x_f32^2) + eps)), the product in dtype.
template <typename T>
void rms_norm_row(const T* x, const T* w, T* out, int64_t hidden, float eps) {
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < hidden; ++i) {
    float v = load_f(x[i]);
    sum += v * v;
  }
  float inv = 1.f / std::sqrt(sum / static_cast<float>(hidden) + eps);
  for (int64_t i = 0; i < hidden; ++i) {
    out[i] = static_cast<T>(load_f(w[i]) * round_to<T>(load_f(x[i]) * inv));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "rms_norm: x must be contiguous [num_tokens, hidden]");
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), hidden = x.size(1);
  const auto w = as_dtype_of(weight, x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) rms_norm_row(xp + r * hidden, wp, op + r * hidden, hidden, (float)eps);
    });
  });
  return out;
}

}  // namespace

// x += y (rounded to dtype, as the reference's residual add), then rms_norm of the new x into `out` (x's shape).
void neuronmm::add_rms_norm_into(at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps,
                                 at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && y.is_contiguous() && x.sizes() == y.sizes(),
              "add_rms_norm: x and y must be contiguous [num_tokens, hidden] of the same shape");
  TORCH_CHECK(x.scalar_type() == y.scalar_type(), "add_rms_norm: x and y dtypes differ");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "add_rms_norm: out must be contiguous, of x's shape and dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const auto w = as_dtype_of(weight, x);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* yp = y.data_ptr<scalar_t>();
    const scalar_t* wp = w.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        scalar_t* xr = xp + r * hidden;
        const scalar_t* yr = yp + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) xr[i] = static_cast<scalar_t>(load_f(xr[i]) + load_f(yr[i]));
        rms_norm_row(xr, wp, op + r * hidden, hidden, (float)eps);
      }
    });
  });
}

// Qwen3's per-head norms, in place: each of the first num_q_heads heads of a qkv row normed with q_weight, the next
// num_kv_heads (the keys) with k_weight, each over head_dim as rms_norm_row norms a row.
void neuronmm::head_rms_norm_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                              int64_t num_q_heads, int64_t num_kv_heads, double eps) {
  const int64_t head_dim = q_weight.size(0), width = qkv.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && k_weight.size(0) == head_dim &&
                  (num_q_heads + num_kv_heads) * head_dim <= width,
              "head_rms_norm_: qkv must be contiguous [num_tokens, >= (q + k heads) x head_dim]");
  const int64_t rows = qkv.size(0);
  const auto qw = as_dtype_of(q_weight, qkv), kw = as_dtype_of(k_weight, qkv);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "head_rms_norm_", [&] {
    scalar_t* p = qkv.data_ptr<scalar_t>();
    const scalar_t* qwp = qw.data_ptr<scalar_t>();
    const scalar_t* kwp = kw.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 8, [&](int64_t b, int64_t e) {
      for (int64_t r = b; r < e; ++r) {
        for (int64_t h = 0; h < num_q_heads + num_kv_heads; ++h) {
          scalar_t* head = p + r * width + h * head_dim;
          rms_norm_row(head, h < num_q_heads ? qwp : kwp, head, head_dim, (float)eps);  // reads before it writes
        }
      }
    });
  });
}

namespace {

at::Tensor head_rms_norm_op(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight,
                            int64_t num_q_heads, int64_t num_kv_heads, double eps) {
  neuronmm::head_rms_norm_(qkv, q_weight, k_weight, num_q_heads, num_kv_heads, eps);
  return qkv;
}

at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps) {
  auto out = at::empty_like(x);
  neuronmm::add_rms_norm_into(x, y, weight, eps, out);
  return out;
}

// ---- silu_mul --------------------------------------------------------------------------------------
// The vector part of a run [i0, i1) of silu_mul; returns where the scalar loop takes over (here: i0, none).
template <typename T>
inline int64_t silu_mul_vector(const T*, const T*, T*, int64_t i0, int64_t) { return i0; }
// fp32 silu(gate) * up a vector at a time, the same operations as the scalar loop (the same bits).
#if defined(__AVX512F__)
inline int64_t silu_mul_vector(const float* gate, const float* up, float* dst, int64_t i0, int64_t i1) {
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m512 g = _mm512_loadu_ps(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, fast_exp16(_mm512_xor_ps(g, sign))));
    _mm512_storeu_ps(dst + i, _mm512_mul_ps(silu, _mm512_loadu_ps(up + i)));
  }
  return i;
}
#elif defined(__AVX2__)
inline int64_t silu_mul_vector(const float* gate, const float* up, float* dst, int64_t i0, int64_t i1) {
  const __m256 one = _mm256_set1_ps(1.f), sign = _mm256_set1_ps(-0.f);
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, fast_exp8(_mm256_xor_ps(g, sign))));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
  }
  return i;
}
#endif
#if defined(__AVX512BF16__)
// bf16 silu(gate) * up 16 at a time, each step rounded as the scalar loop rounds it (the same bits: the compiler
// left that loop scalar, ~1 ns a value).
inline int64_t silu_mul_vector(const c10::BFloat16* gate, const c10::BFloat16* up, c10::BFloat16* dst, int64_t i0,
                               int64_t i1) {
  const __m512 one = _mm512_set1_ps(1.f), sign = _mm512_set1_ps(-0.f);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
    const __m512 g = load16(gate + i);
    const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, fast_exp16(_mm512_xor_ps(g, sign))));
    const __m512 rounded = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu));  // to bf16 and back, as round_to does
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_mul_ps(rounded, load16(up + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)out);
  }
  return i;
}
#endif

}  // namespace

// gate_up [num_tokens, 2 * inter] (gate then up) -> silu(gate) * up into `out` [num_tokens, inter], each rounded as
// the reference.
void neuronmm::silu_mul_into(const at::Tensor& gate_up, at::Tensor& out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be contiguous [num_tokens, 2 * inter]");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == rows && out.size(1) == inter &&
                  out.scalar_type() == gate_up.scalar_type(),
              "silu_mul: out must be contiguous [num_tokens, inter] in gate_up's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows * inter, 1024, [&](int64_t b, int64_t e) {
      for (int64_t k = b; k < e;) {  // contiguous runs within a row, so the inner loop vectorises
        const int64_t r = k / inter, i0 = k % inter, i1 = std::min(inter, i0 + (e - k));
        const scalar_t* gate = gp + r * 2 * inter;
        const scalar_t* up = gate + inter;
        scalar_t* dst = op + r * inter;
        int64_t i = i0;
        i = silu_mul_vector(gate, up, dst, i0, i1);
        for (; i < i1; ++i) {
          const float g = load_f(gate[i]);
          dst[i] = static_cast<scalar_t>(round_to<scalar_t>(g / (1.f + fast_exp(-g))) * load_f(up[i]));
        }
        k += i1 - i0;
      }
    });
  });
}

namespace {

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2, "silu_mul: gate_up must be contiguous [num_tokens, 2 * inter]");
  auto out = at::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  neuronmm::silu_mul_into(gate_up, out);
  return out;
}

// ---- attention -------------------------------------------------------------------------------------
// Rotate q, k of every token (HF's x*cos + rotate_half(x)*sin, each product rounded to dtype), write
// k, v into the cache at the token's slot, then attend each token with context_lens[t] > 0 over the
// first context_lens[t] positions of its sequence (block_tables[seq_index[t]]). Tokens with
// context_lens[t] == 0 are left for the caller (their output rows are zero). T is the model's dtype, C the
// cache's: T itself, fp16 / bf16 under an fp32 model (half the bytes to read a step, as llama.cpp's f16 cache), or
// fp8 e4m3fn under either (a byte a value, vLLM's `--kv-cache-dtype fp8` without scales).
constexpr int64_t kPrefetchBlocks = 2;  // how far ahead (in cache blocks) attention prefetches keys and values

template <typename T, typename C>
void attention_impl(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& seq_index, const at::Tensor& context_lens, int64_t num_heads,
                    int64_t num_kv_heads, double scale, at::Tensor& q_rot, at::Tensor& out) {
  const int64_t num_tokens = qkv.size(0);
  const int64_t head_dim = k_cache.size(3), half = head_dim / 2;
  const int64_t block_size = k_cache.size(2);
  const int64_t row = qkv.size(1);
  const int64_t max_blocks = block_tables.size(1);
  const T* qkv_p = qkv.data_ptr<T>();
  const T* cos_p = cos.data_ptr<T>();
  const T* sin_p = sin.data_ptr<T>();
  C* kc = k_cache.data_ptr<C>();
  C* vc = v_cache.data_ptr<C>();
  T* qr = q_rot.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* seq_of = seq_index.data_ptr<int32_t>();
  const int32_t* ctx = context_lens.data_ptr<int32_t>();
  // element offset of (slot, kv_head) in a cache tensor
  auto cache_at = [&](int64_t slot, int64_t h) {
    return ((slot / block_size * num_kv_heads + h) * block_size + slot % block_size) * head_dim;
  };
  // dst: a T (q, or a cache in T) or fp32 (a row staged for a cache in another dtype). The two halves in two loops
  // (which half a value comes from decided by the loop, not a branch per value), so the compiler vectorises them.
  auto rotate = [&](const T* x, const T* c, const T* s, auto* dst) {
    using D = std::remove_pointer_t<decltype(dst)>;
    const auto one = [&](int64_t i, float rot) {
      float a = round_to<T>(load_f(x[i]) * load_f(c[i]));
      float b = round_to<T>(round_to<T>(rot) * load_f(s[i]));
      if constexpr (std::is_same_v<D, T>) dst[i] = static_cast<D>(round_to<T>(a + b));
      else dst[i] = to_cache<D>(round_to<T>(a + b));
    };
    for (int64_t i = 0; i < half; ++i) one(i, -load_f(x[i + half]));
    for (int64_t i = half; i < head_dim; ++i) one(i, load_f(x[i - half]));
  };
  at::parallel_for(0, num_tokens, 1, [&](int64_t b, int64_t e) {
    constexpr bool narrow = !std::is_same_v<T, C>;  // a cache dtype other than the model's: rows staged in fp32
    thread_local std::vector<float> staged;  // a row in fp32 before its vector store (kept, as the scratch below)
    if constexpr (narrow) staged.resize(head_dim);
    for (int64_t t = b; t < e; ++t) {
      const T* src = qkv_p + t * row;
      const T* c = cos_p + t * head_dim;
      const T* s = sin_p + t * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) rotate(src + h * head_dim, c, s, qr + (t * num_heads + h) * head_dim);
      const T* k = src + num_heads * head_dim;
      const T* v = k + num_kv_heads * head_dim;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        int64_t at_ = cache_at(slots[t], h);
        if constexpr (narrow) {
          rotate(k + h * head_dim, c, s, staged.data());
          store_cache_row(staged.data(), head_dim, kc + at_);
          for (int64_t i = 0; i < head_dim; ++i) staged[i] = load_f(v[h * head_dim + i]);
          store_cache_row(staged.data(), head_dim, vc + at_);
        } else {
          rotate(k + h * head_dim, c, s, kc + at_);
          std::memcpy(vc + at_, v + h * head_dim, head_dim * sizeof(T));
        }
      }
    }
  });
  const int64_t group = num_heads / num_kv_heads;
  // An fp32 model's runs of a sequence's consecutive positions (prefill chunks) attend in tiles
  // (prefill_attention.h), the other tokens one by one below. The lists are kept per calling thread (30 calls a
  // step), and named through references: a lambda that names a thread_local reads the running thread's own copy.
  thread_local std::vector<neuronmm::PrefillTile> kept_tiles;
  thread_local std::vector<int64_t> kept_singles;
  std::vector<neuronmm::PrefillTile>& tiles = kept_tiles;
  std::vector<int64_t>& singles = kept_singles;
  const int64_t tile_tokens = std::is_same_v<T, float> ? neuronmm::prefill_tile_tokens(group, head_dim) : 0;
  neuronmm::split_prefill_runs(num_tokens, seq_of, ctx, tile_tokens, tiles, singles);
  if constexpr (std::is_same_v<T, float>) {
    if (!tiles.empty())
      neuronmm::attend_prefill_tiles<C>(tiles, qr, kc, vc, tables, max_blocks, seq_of, ctx, num_heads, num_kv_heads,
                                        head_dim, block_size, static_cast<float>(scale), op);
  }
  const int64_t num_singles = static_cast<int64_t>(singles.size());
  // Work item: one token and a run of its KV heads, each with the query heads that share it, so a cached
  // key or value is read (and widened to fp32) once per group. With enough tokens to keep every thread
  // busy an item takes all of a token's KV heads: a block of the cache [kv_heads, block_size, head_dim]
  // is then read front to back as one stream (reading one head's slice of many blocks in turn is ~1.6x
  // slower on a cold cache with 16-token blocks: the hardware prefetcher runs ahead into the other heads'
  // slices). With few tokens (small decode batches) an item is one KV head, for parallelism.
  const int64_t heads_per_item = num_singles >= 2 * at::get_num_threads() ? num_kv_heads : 1;
  const int64_t items_per_token = num_kv_heads / heads_per_item;
  const int64_t item_heads = heads_per_item * group;  // query heads of an item
  // An item costs its token's context (a prefill chunk's tokens see from a few to all of the chunk's positions;
  // a batch's sequences differ in length), and a thread that finishes early takes others' items.
  const int64_t items = num_singles * items_per_token;
  std::vector<int64_t> cost_before(items + 1, 0);
  for (int64_t item = 0; item < items; ++item)
    cost_before[item + 1] = cost_before[item] + 1 + ctx[singles[item / items_per_token]];
  // keys or values of KV head kv0 + k of the sequence whose block table is `table`, at positions start.. (within one
  // block)
  const auto block_of = [&](const C* cache, const int32_t* table, int64_t kv0, int64_t start, int64_t k) {
    return cache + ((static_cast<int64_t>(table[start / block_size]) * num_kv_heads + kv0 + k) * block_size +
                    start % block_size) * head_dim;
  };
  neuronmm::balanced_for(items, [&](int64_t item) { return cost_before[item]; }, [&](const auto& next) {
    // per-thread scratch, kept across calls (a decode step makes 30 of them: fresh buffers were five heap allocations
    // and frees per thread per call)
    thread_local std::vector<float> scores, acc, q, inv, widened;
    acc.resize(item_heads * head_dim);
    q.resize(item_heads * head_dim);
    inv.resize(item_heads);
    widened.resize(16 * head_dim);  // 16 rows of an fp8 cache, widened once for a group's query heads
    const auto run_item = [&](int64_t item, int64_t following) {  // following: the thread's next item, or -1
      const int64_t t = singles[item / items_per_token], kv0 = item % items_per_token * heads_per_item;
      const int64_t h0 = kv0 * group;  // first query head of the item
      T* dst = op + (t * num_heads + h0) * head_dim;
      const int64_t n = ctx[t];
      if (n == 0) {
        std::fill(dst, dst + item_heads * head_dim, static_cast<T>(0.f));
        return;
      }
      const int32_t* table = tables + static_cast<int64_t>(seq_of[t]) * max_blocks;
      const T* qp = qr + (t * num_heads + h0) * head_dim;
      for (int64_t i = 0; i < item_heads * head_dim; ++i) q[i] = load_f(qp[i]) * (float)scale;
      scores.resize(item_heads * n);
      const auto block_at = [&](const C* cache, int64_t start, int64_t k) { return block_of(cache, table, kv0, start, k); };
      // What to fetch while reading a block: the block kPrefetchBlocks ahead in the order this thread reads them (the
      // item's keys, its values, then the next item's keys), a row per row read. Each pass then starts on lines
      // already on their way: with a cold start per pass, a 192-position item read a sixth of its bytes cold.
      const int64_t padded = (n + block_size - 1) / block_size * block_size;
      const int64_t t_next = following < 0 ? -1 : singles[following / items_per_token];
      const auto ahead_of = [&](bool values, int64_t start, int64_t k) -> const C* {
        int64_t at = start + kPrefetchBlocks * block_size + (values ? padded : 0);
        if (at < padded) return block_at(kc, at, k);
        if ((at -= padded) < padded) return block_at(vc, at, k);
        if (t_next < 0 || (at -= padded) >= ctx[t_next]) return nullptr;
        return block_of(kc, tables + static_cast<int64_t>(seq_of[t_next]) * max_blocks,
                        following % items_per_token * heads_per_item, at, k);
      };
      for (int64_t start = 0; start < n; start += block_size) {
        const int64_t len = std::min(block_size, n - start);
        for (int64_t k = 0; k < heads_per_item; ++k) {
          const C* kb = block_at(kc, start, k);
          const C* next_k = ahead_of(false, start, k);  // fetched as this block is read
          int64_t j = 0;
#if defined(__AVX512F__)
          if constexpr (kVectorAttention<C>) {
            if (head_dim == 64 || head_dim == 128) {
              for (; j + 16 <= len; j += 16) {
                if constexpr (std::is_same_v<C, c10::Float8_e4m3fn>) {
                  const C* keys = kb + j * head_dim;
                  const C* ahead = j == 0 ? next_k : nullptr;
#if defined(__AVX512BF16__)
                  if constexpr (std::is_same_v<T, c10::BFloat16>) {
                    auto* kw = reinterpret_cast<c10::BFloat16*>(widened.data());
                    const __m512 sc = _mm512_set1_ps(static_cast<float>(scale));
                    if (head_dim == 64) widen16_keys<4>(keys, kw, ahead); else widen16_keys<8>(keys, kw, ahead);
                    for (int64_t g = k * group; g < (k + 1) * group; ++g)
                      _mm512_storeu_ps(scores.data() + g * n + start + j,
                                       head_dim == 64 ? dot16_keys_bf16<2>(qp + g * head_dim, kw, sc)
                                                      : dot16_keys_bf16<4>(qp + g * head_dim, kw, sc));
                    continue;
                  }
#endif
                  float* kw = widened.data();
                  if (head_dim == 64) widen16_keys<4>(keys, kw, ahead); else widen16_keys<8>(keys, kw, ahead);
                  for (int64_t g = k * group; g < (k + 1) * group; ++g)
                    _mm512_storeu_ps(scores.data() + g * n + start + j,
                                     head_dim == 64 ? dot16_keys<float, 4>(q.data() + g * head_dim, kw)
                                                    : dot16_keys<float, 8>(q.data() + g * head_dim, kw));
                  continue;
                }
                for (int64_t g = k * group; g < (k + 1) * group; ++g) {
                  const C* ahead = j == 0 ? next_k : nullptr;  // once per block, its rows shared among the group
                  const RowShare share{int(g - k * group), int(group)};
                  const C* keys = kb + j * head_dim;
#if defined(__AVX512BF16__)
                  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<C, c10::BFloat16>) {
                    const __m512 sc = _mm512_set1_ps(static_cast<float>(scale));
                    const __m512 r = head_dim == 64 ? dot16_keys_bf16<2>(qp + g * head_dim, keys, sc, ahead, share)
                                                    : dot16_keys_bf16<4>(qp + g * head_dim, keys, sc, ahead, share);
                    _mm512_storeu_ps(scores.data() + g * n + start + j, r);
                    continue;
                  }
#endif
                  const __m512 r = head_dim == 64 ? dot16_keys<C, 4>(q.data() + g * head_dim, keys, ahead, share)
                                                  : dot16_keys<C, 8>(q.data() + g * head_dim, keys, ahead, share);
                  _mm512_storeu_ps(scores.data() + g * n + start + j, r);
                }
              }
            }
          }
#elif defined(__AVX2__) && defined(__FMA__)
          if constexpr (kAvx2Attention<C>) {
            if (head_dim == 64) {
              for (; j + 8 <= len; j += 8) {
                if constexpr (kWidenOnce<C>) {
                  widen_rows64(kb + j * head_dim, 8, widened.data(), next_k ? next_k + j * head_dim : nullptr);
                  for (int64_t g = k * group; g < (k + 1) * group; ++g)
                    _mm256_storeu_ps(scores.data() + g * n + start + j,
                                     dot8_keys64_avx2<float>(q.data() + g * head_dim, widened.data(), nullptr));
                  continue;
                }
                if (dot8_keys_group_avx2<64>(group, q.data() + k * group * head_dim, kb + j * head_dim,
                                             next_k ? next_k + j * head_dim : nullptr,
                                             scores.data() + k * group * n + start + j, n))
                  continue;
                for (int64_t g = k * group; g < (k + 1) * group; ++g) {
                  const C* ahead = next_k ? next_k + j * head_dim : nullptr;  // once a row, shared among the group
                  const __m256 r = dot8_keys64_avx2(q.data() + g * head_dim, kb + j * head_dim, ahead,
                                                    RowShare{int(g - k * group), int(group)});
                  _mm256_storeu_ps(scores.data() + g * n + start + j, r);
                }
              }
            } else if (head_dim == 128 && kWidens128<C>) {  // (a group without grouped loops: dot_head below)
              for (; j + 8 <= len; j += 8)
                if (!dot8_keys_group_avx2<128>(group, q.data() + k * group * head_dim, kb + j * head_dim,
                                               next_k ? next_k + j * head_dim : nullptr,
                                               scores.data() + k * group * n + start + j, n))
                  break;
            }
          }
#endif
          for (; j < len; ++j) {
            for (int64_t g = k * group; g < (k + 1) * group; ++g)
              scores[g * n + start + j] = dot_head(q.data() + g * head_dim, kb + j * head_dim, head_dim);
          }
        }
      }
      for (int64_t g = 0; g < item_heads; ++g) {  // the max after the scores, in one vector pass per head
        float* sg = scores.data() + g * n;
        inv[g] = 1.f / exp_block(sg, sg, 0, n, row_max(sg, n), 1.f);  // in place; x * 1 is exact
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < n; start += block_size) {
        const int64_t len = std::min(block_size, n - start);
        for (int64_t k = 0; k < heads_per_item; ++k) {
          const C* vb = block_at(vc, start, k);
          const C* next_v = ahead_of(true, start, k);
#if defined(__AVX512F__)
          if constexpr (kVectorAttention<C>) {
            const float* p = scores.data() + k * group * n + start;
            float* a = acc.data() + k * group * head_dim;
            if (head_dim == 64) {
              pv_group<C, 4>(p, n, vb, len, a, group, next_v);
              continue;
            }
            if (head_dim == 128) {
              pv_group<C, 8>(p, n, vb, len, a, group, next_v);
              continue;
            }
          }
#endif
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
          if constexpr (kAvx2Attention<C>) {
            if (head_dim == 128 && kWidens128<C> &&
                pv_group_avx2<128>(group, scores.data() + k * group * n + start, n, vb, len,
                                   acc.data() + k * group * head_dim, next_v))
              continue;
            if (head_dim == 64) {
              if constexpr (kWidenOnce<C>) {
                for (int64_t r0 = 0; r0 < len; r0 += 16) {  // `widened` holds 16 rows
                  const int64_t rows = std::min<int64_t>(16, len - r0);
                  widen_rows64(vb + r0 * head_dim, rows, widened.data(), next_v ? next_v + r0 * head_dim : nullptr);
                  for (int64_t g = k * group; g < (k + 1) * group; ++g)
                    pv_head64_avx2(scores.data() + g * n + start + r0, widened.data(), rows, acc.data() + g * head_dim,
                                   static_cast<const float*>(nullptr));
                }
                continue;
              }
              if (pv_group_avx2<64>(group, scores.data() + k * group * n + start, n, vb, len,
                                    acc.data() + k * group * head_dim, next_v))
                continue;
              for (int64_t g = k * group; g < (k + 1) * group; ++g)
                pv_head64_avx2(scores.data() + g * n + start, vb, len, acc.data() + g * head_dim,
                               g == k * group ? next_v : nullptr);
              continue;
            }
          }
#endif
          for (int64_t j = 0; j < len; ++j)
            for (int64_t g = k * group; g < (k + 1) * group; ++g)
              axpy_head(scores[g * n + start + j], vb + j * head_dim, acc.data() + g * head_dim, head_dim);
        }
      }
      for (int64_t g = 0; g < item_heads; ++g)
        for (int64_t i = 0; i < head_dim; ++i) dst[g * head_dim + i] = static_cast<T>(acc[g * head_dim + i] * inv[g]);
    };
    // one item claimed ahead, so the last blocks of an item fetch the first of the next
    int64_t item, following;
    for (bool have = next(item); have;) {
      const bool more = next(following);
      run_item(item, more ? following : -1);
      item = following;
      have = more;
    }
  });
}

}  // namespace

void neuronmm::attention_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                              const at::Tensor& seq_index, const at::Tensor& context_lens, int64_t num_heads,
                              int64_t num_kv_heads, double scale, at::Tensor& q_rot, at::Tensor& out) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "attention: qkv must be contiguous [num_tokens, (H + 2 Hkv) D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "attention: bad cache layout");
  const int64_t head_dim = k_cache.size(3);
  TORCH_CHECK(qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim, "attention: qkv width does not match heads");
  TORCH_CHECK(num_heads % num_kv_heads == 0 && head_dim % 2 == 0, "attention: bad head counts");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == head_dim, "attention: bad rotary tables");
  const auto dtype = qkv.scalar_type(), cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "attention: qkv and rotary tables must share a dtype");
  const bool fp8 = cache_dtype == at::kFloat8_e4m3fn && (dtype == at::kFloat || dtype == at::kBFloat16);
  TORCH_CHECK(v_cache.scalar_type() == cache_dtype &&
                  (cache_dtype == dtype || fp8 ||
                   (dtype == at::kFloat && (cache_dtype == at::kHalf || cache_dtype == at::kBFloat16))),
              "attention: the cache holds qkv's dtype, fp16 / bf16 under fp32 qkv, or fp8 e4m3fn under fp32 / bf16");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && block_tables.scalar_type() == at::kInt &&
                  seq_index.scalar_type() == at::kInt && context_lens.scalar_type() == at::kInt,
              "attention: index dtypes are int64 slots, int32 tables/seq_index/context_lens");
  const int64_t num_tokens = qkv.size(0);
  TORCH_CHECK(q_rot.is_contiguous() && q_rot.numel() == num_tokens * num_heads * head_dim && out.is_contiguous() &&
                  out.numel() == num_tokens * num_heads * head_dim && q_rot.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "attention: q_rot and out must be contiguous, num_tokens x heads x head_dim in qkv's dtype");
  const auto run = [&](auto model, auto cache) {
    attention_impl<decltype(model), decltype(cache)>(qkv, cos, sin, k_cache, v_cache, slot_mapping.contiguous(),
                                                     block_tables.contiguous(), seq_index.contiguous(),
                                                     context_lens.contiguous(), num_heads, num_kv_heads, scale, q_rot, out);
  };
  if (fp8 && dtype == at::kFloat) {
    run(float{}, c10::Float8_e4m3fn{});
  } else if (fp8) {
    run(c10::BFloat16{}, c10::Float8_e4m3fn{});
  } else if (cache_dtype == at::kHalf && dtype == at::kFloat) {
    run(float{}, c10::Half{});
  } else if (cache_dtype == at::kBFloat16 && dtype == at::kFloat) {
    run(float{}, c10::BFloat16{});
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "attention", [&] { run(scalar_t{}, scalar_t{}); });
  }
}

namespace {

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                                             at::Tensor& k_cache, at::Tensor& v_cache,
                                             const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                             const at::Tensor& seq_index, const at::Tensor& context_lens,
                                             int64_t num_heads, int64_t num_kv_heads, double scale) {
  TORCH_CHECK(qkv.dim() == 2 && k_cache.dim() == 4, "attention: qkv [num_tokens, (H + 2 Hkv) D] and a 4-d cache expected");
  const int64_t num_tokens = qkv.size(0), head_dim = k_cache.size(3);
  auto q_rot = at::empty({num_tokens, num_heads, head_dim}, qkv.options());
  auto out = at::empty({num_tokens, num_heads * head_dim}, qkv.options());
  neuronmm::attention_into(qkv, cos, sin, k_cache, v_cache, slot_mapping, block_tables, seq_index, context_lens,
                           num_heads, num_kv_heads, scale, q_rot, out);
  return {out, q_rot};
}

// ---- sample_temperature ------------------------------------------------------------------------
// Plain temperature sampling (no top-k/top-p) of each row of fp32 logits [rows, vocab]: the token where
// uniforms[r] falls in the cumulative distribution of softmax(logits[r] / T_r), i.e. inverse-CDF
// sampling with one uniform per row, as server/engine/sampler.py's torch path does. One pass of
// exp((x - max) / T) writes the unnormalised probabilities and their 256-column block sums, so the
// target is found by scanning the block sums (fp64), then one block. A column with zero probability is
// never chosen (the pick moves back to the last positive column of its block).
constexpr int64_t kCdfBlock = 256;


int64_t sample_row(const float* logits, float* probs, double* block_sums, int64_t vocab, float inv_t, double u) {
  const float max_x = row_max(logits, vocab);
  const int64_t num_blocks = (vocab + kCdfBlock - 1) / kCdfBlock;
  double total = 0.0;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t lo = b * kCdfBlock, hi = std::min(vocab, lo + kCdfBlock);
    block_sums[b] = exp_block(logits, probs, lo, hi, max_x, inv_t);
    total += block_sums[b];
  }
  double target = u * total, before = 0.0;
  int64_t b = 0;
  while (b < num_blocks - 1 && before + block_sums[b] <= target) before += block_sums[b++];
  const int64_t lo = b * kCdfBlock, hi = std::min(vocab, lo + kCdfBlock);
  double cum = before;
  int64_t last_positive = lo;
  for (int64_t i = lo; i < hi; ++i) {
    if (probs[i] > 0.f) last_positive = i;
    cum += probs[i];
    if (cum > target && probs[i] > 0.f) return i;
  }
  return last_positive;
}

at::Tensor sample_temperature(const at::Tensor& logits, const at::Tensor& inv_temps, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_temperature: contiguous fp32 logits [rows, vocab] expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(inv_temps.numel() == rows && uniforms.numel() == rows, "sample_temperature: one temperature and one uniform per row");
  const auto t = inv_temps.to(at::kFloat).contiguous();
  const auto u = uniforms.to(at::kDouble).contiguous();
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* tp = t.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    // kept per thread: a fresh 200 KB buffer a call would be a new mmap and its page faults every step
    thread_local std::vector<float> probs;
    thread_local std::vector<double> block_sums;
    probs.resize(vocab);
    block_sums.resize((vocab + kCdfBlock - 1) / kCdfBlock);
    for (int64_t r = b; r < e; ++r) out[r] = sample_row(lp + r * vocab, probs.data(), block_sums.data(), vocab, tp[r], up[r]);
  });
  return tokens;
}

// ---- argmax_rows -----------------------------------------------------------------------------------
// Greedy decoding's argmax of each row of fp32 logits [rows, vocab]: the first index of the row's largest
// value, as torch.argmax gives it (a row of -inf gives 0; NaN is never chosen, where torch would pick it).
// torch's CPU argmax runs one row on one thread at ~0.6 ns a value: 0.5 ms of a batch-16 step over a 49k
// vocabulary; here 16 lanes (AVX2: 8) a compare, rows over the threads.
int64_t argmax_row(const float* x, int64_t n) {
  float best = -INFINITY;
  int64_t at = 0, i = 0;
#if defined(__AVX512F__)
  // per lane: the largest value seen and the block it came first in (strictly greater replaces)
  __m512 vbest = _mm512_set1_ps(-INFINITY);
  __m512i vblock = _mm512_setzero_si512(), block = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  for (; i + 16 <= n; i += 16, block = _mm512_add_epi32(block, one)) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 greater = _mm512_cmp_ps_mask(v, vbest, _CMP_GT_OQ);
    vbest = _mm512_mask_mov_ps(vbest, greater, v);
    vblock = _mm512_mask_mov_epi32(vblock, greater, block);
  }
  if (i > 0) {
    best = _mm512_reduce_max_ps(vbest);
    alignas(64) float values[16];
    alignas(64) int32_t blocks[16];
    _mm512_store_ps(values, vbest);
    _mm512_store_si512(blocks, vblock);
    at = std::numeric_limits<int64_t>::max();
    for (int lane = 0; lane < 16; ++lane)
      if (values[lane] == best) at = std::min<int64_t>(at, int64_t(blocks[lane]) * 16 + lane);
  }
#elif defined(__AVX2__)
  // the same on 8 lanes: blend in the greater values and their block numbers
  __m256 vbest = _mm256_set1_ps(-INFINITY);
  __m256i vblock = _mm256_setzero_si256(), block = _mm256_setzero_si256();
  const __m256i one = _mm256_set1_epi32(1);
  for (; i + 8 <= n; i += 8, block = _mm256_add_epi32(block, one)) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 greater = _mm256_cmp_ps(v, vbest, _CMP_GT_OQ);
    vbest = _mm256_blendv_ps(vbest, v, greater);
    vblock = _mm256_blendv_epi8(vblock, block, _mm256_castps_si256(greater));
  }
  if (i > 0) {
    alignas(32) float values[8];
    alignas(32) int32_t blocks[8];
    _mm256_store_ps(values, vbest);
    _mm256_store_si256(reinterpret_cast<__m256i*>(blocks), vblock);
    best = *std::max_element(values, values + 8);
    at = std::numeric_limits<int64_t>::max();
    for (int lane = 0; lane < 8; ++lane)
      if (values[lane] == best) at = std::min<int64_t>(at, int64_t(blocks[lane]) * 8 + lane);
  }
#endif
  for (; i < n; ++i)
    if (x[i] > best) best = x[i], at = i;
  return at;
}

at::Tensor argmax_rows(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "argmax_rows: contiguous fp32 logits [rows, vocab] expected");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto tokens = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) out[r] = argmax_row(lp + r * vocab, vocab);
  });
  return tokens;
}

}  // namespace

TORCH_LIBRARY(neuronmm, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor y, Tensor weight, float eps) -> Tensor");
  m.def("head_rms_norm_(Tensor(a!) qkv, Tensor q_weight, Tensor k_weight, int num_q_heads, int num_kv_heads, "
        "float eps) -> Tensor(a!)");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("sample_temperature(Tensor logits, Tensor inv_temps, Tensor uniforms) -> Tensor");
  m.def("argmax_rows(Tensor logits) -> Tensor");
  m.def(
      "attention(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
      "Tensor block_tables, Tensor seq_index, Tensor context_lens, int num_heads, int num_kv_heads, float scale) "
      "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("head_rms_norm_", &head_rms_norm_op);
  m.impl("silu_mul", &silu_mul);
  m.impl("sample_temperature", &sample_temperature);
  m.impl("argmax_rows", &argmax_rows);
  m.impl("attention", &attention);
}
