// The arithmetic peak of this build's vector units on every thread, for the benchmarks' compute floors
// (bench/peak_rate.py): a step's FLOPs over this rate is the shortest time its GEMMs could take, as its bytes over
// the read bandwidth (stream_read_rate below, bench/read_bandwidth.py) is the shortest time its stream could.
//
// Each thread runs twelve independent chains of one multiply-add instruction on registers, with nothing to load or
// store, so the rate is the units' own: fp32 FMAs (what an fp32 model's GEMMs run on every x86 CPU), VDPBF16PS
// (bf16 pairs, AVX512-BF16) and VPDPBUSD (int8 quads, AVX512-VNNI). AMX is not probed.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
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

// The memory floor's rate: bytes per second at which every thread reads its share of `data` front to back, best
// of `repeats` passes after one untimed one (`data` contiguous; a share is a whole number of 128-byte line pairs,
// and what is left over is not read). Each line is one vector load (two on AVX2), matched by a software prefetch
// of the line 8 KB ahead, as the GEMM tiles stream their weights. A core's own draw from memory caps a stream,
// and prefetches keep more of its lines on their way: over 512 MB on the Emerald Rapids VM, two threads read
// 27.1-35.8 GB/s this way where torch.sum's loop, prefetched by the hardware alone, read 15.6-25.1 in the same runs
// (bench.read_bandwidth), and the AMX tiles streamed a step's weights at ~27.7: the sum alone put the memory floor
// below what ran.
constexpr int64_t kStreamAhead = 8192;  // bytes

uint64_t read_lines(const char* p, int64_t bytes) {
#if defined(__AVX512F__)
  __m512i a = _mm512_setzero_si512(), b = a;
  for (int64_t off = 0; off < bytes; off += 128) {
    _mm_prefetch(p + off + kStreamAhead, _MM_HINT_T0);
    _mm_prefetch(p + off + 64 + kStreamAhead, _MM_HINT_T0);
    a = _mm512_add_epi64(a, _mm512_loadu_si512(p + off));
    b = _mm512_add_epi64(b, _mm512_loadu_si512(p + off + 64));
  }
  return _mm512_reduce_add_epi64(_mm512_add_epi64(a, b));
#elif defined(__AVX2__)
  __m256i a = _mm256_setzero_si256(), b = a;
  for (int64_t off = 0; off < bytes; off += 64) {
    _mm_prefetch(p + off + kStreamAhead, _MM_HINT_T0);
    a = _mm256_add_epi64(a, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off)));
    b = _mm256_add_epi64(b, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + off + 32)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_add_epi64(a, b));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
#else
  uint64_t sum = 0;
  for (int64_t off = 0; off < bytes; off += 8) sum += *reinterpret_cast<const uint64_t*>(p + off);
  return sum;
#endif
}

double stream_read_rate(const at::Tensor& data, int64_t repeats) {
  TORCH_CHECK(data.device().is_cpu() && data.is_contiguous(), "stream_read_rate: a contiguous CPU tensor expected");
  TORCH_CHECK(repeats > 0, "stream_read_rate: repeats must be positive");
  const int64_t threads = at::get_num_threads(), lines = data.nbytes() / 128 / threads * 2;  // (pairs: read_lines)
  TORCH_CHECK(lines > 0, "stream_read_rate: the tensor must hold at least two 64-byte lines per thread");
  const char* base = static_cast<const char*>(data.data_ptr());
  std::vector<uint64_t> sink(threads * 8, 0);  // a line a thread: the sums leave the loop, so it is not elided
  double best = 0;
  for (int64_t r = 0; r <= repeats; ++r) {  // pass 0 untimed: it brings the pages into the TLBs
    const auto start = std::chrono::steady_clock::now();
    at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
      for (int64_t t = b; t < e; ++t) sink[t * 8] += read_lines(base + t * lines * 64, lines * 64);
    });
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (r > 0) best = std::max(best, double(threads * lines * 64) / seconds);
  }
  asm volatile("" : : "r"(sink.data()) : "memory");
  return best;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.def("peak_kinds() -> str[]", &peak_kinds);  // no tensors: catch-all kernels
  m.def("peak_rate(str kind, int rounds) -> float", &peak_rate);
  m.def("stream_read_rate(Tensor data, int repeats) -> float");
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) { m.impl("stream_read_rate", &stream_read_rate); }
