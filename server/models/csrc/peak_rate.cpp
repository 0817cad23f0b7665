// The arithmetic peak of this build's vector units on every thread, for the benchmarks' compute floors
// (bench/peak_rate.py): a step's FLOPs over this rate is the shortest time its GEMMs could take, as its bytes over
// the read bandwidth is the shortest time its stream could.
//
// Each thread runs twelve independent chains of one multiply-add instruction on registers, with nothing to load or
// store, so the rate is the units' own: fp32 FMAs (what an fp32 model's GEMMs run on every x86 CPU), VDPBF16PS
// (bf16 pairs, AVX512-BF16) and VPDPBUSD (int8 quads, AVX512-VNNI). AMX is not probed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <chrono>
#include <string>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#define NEURONMM_PEAK_PROBES  // x86 vector registers ("v" below); other builds probe nothing
#endif

namespace {

#if defined(NEURONMM_PEAK_PROBES)
// `rounds` rounds of 12 independent chain steps (step(acc) -> acc, ops_per_step arithmetic operations each) on every
// thread; returns operations per second over all threads, timed around the parallel region. Twelve chains: more than
// latency x pipes of every core measured (4 cycles x 2 pipes). Named sums, not an array: the AVX2 build kept an array
// of them on the stack and ran every chain through memory at a quarter of the rate.
template <typename V, typename Step>
double rate(int64_t rounds, double ops_per_step, V init, Step step) {
  TORCH_CHECK(rounds > 0, "peak_rate: rounds must be positive");
  const int64_t threads = at::get_num_threads();
  std::vector<float> sink(threads * 16, 0.0f);  // a line a thread: the sums leave the loop, so it is not elided
  const auto start = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      V a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init, a6 = init, a7 = init, a8 = init, a9 = init,
        a10 = init, a11 = init;
      for (int64_t r = 0; r < rounds; ++r) {
        // each step opaque to the compiler: it may neither fold a chain nor drop a step
        a0 = step(a0), a1 = step(a1), a2 = step(a2), a3 = step(a3), a4 = step(a4), a5 = step(a5);
        a6 = step(a6), a7 = step(a7), a8 = step(a8), a9 = step(a9), a10 = step(a10), a11 = step(a11);
        asm("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        asm("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
      }
      for (const V& a : {a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11}) sink[t * 16] += float(a[0]);
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  asm volatile("" : : "r"(sink.data()) : "memory");
  return double(threads) * double(rounds) * 12 * ops_per_step / seconds;
}
#endif

// The kinds this build can probe.
std::vector<std::string> peak_kinds() {
  std::vector<std::string> kinds;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
  kinds.emplace_back("fp32_fma");
#endif
#if defined(__AVX512BF16__)
  kinds.emplace_back("bf16_dot");
#endif
#if defined(__AVX512VNNI__)
  kinds.emplace_back("int8_dot");
#endif
  return kinds;
}

// Arithmetic operations per second (a multiply-add counts two) of `kind` over `rounds` rounds on every thread.
double peak_rate(const std::string& kind, int64_t rounds) {
#if defined(__AVX512F__)
  if (kind == "fp32_fma") {  // x = x * 0.5 + 1 converges to 2: no overflow, no denormals
    const __m512 half = _mm512_set1_ps(0.5f), one = _mm512_set1_ps(1.0f);
    return rate(rounds, 2.0 * 16, one, [=](__m512 x) { return _mm512_fmadd_ps(x, half, one); });
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if (kind == "fp32_fma") {
    const __m256 half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
    return rate(rounds, 2.0 * 8, one, [=](__m256 x) { return _mm256_fmadd_ps(x, half, one); });
  }
#endif
#if defined(__AVX512BF16__)
  if (kind == "bf16_dot") {  // 16 lanes x 2 products and their sums; x grows by 2^-19 a step
    const __m512bh w = (__m512bh)_mm512_set1_epi16(0x3A80);  // 2^-10 in bf16
    return rate(rounds, 4.0 * 16, _mm512_setzero_ps(), [=](__m512 x) { return _mm512_dpbf16_ps(x, w, w); });
  }
#endif
#if defined(__AVX512VNNI__)
  if (kind == "int8_dot") {  // 16 lanes x 4 byte products and their sums; x grows by 4 a step
    const __m512i ones = _mm512_set1_epi8(1);
    return rate(rounds, 8.0 * 16, _mm512_setzero_si512(),
                [=](__m512i x) { return _mm512_dpbusd_epi32(x, ones, ones); });
  }
#endif
  TORCH_CHECK(false, "peak_rate: this build has no '", kind, "' (it has: ", c10::Join(", ", peak_kinds()), ")");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.def("peak_kinds() -> str[]", &peak_kinds);  // no tensors: catch-all kernels
  m.def("peak_rate(str kind, int rounds) -> float", &peak_rate);
}
