// Panel GEMMs with int8 weights (`--quantization int8`): y[M, N] = x[M, K] · Wᵀ with W quantised per output column
// (w ≈ s_n · q, q in -127..127) and each row of x quantised at run time per 64 inputs (x ≈ s_b · r, r in -127..127),
// as llama.cpp's q8_0 multiplies its blocks. The products of a block are exact int32 sums (VPDPBUSD: 64 products an
// instruction, twice VDPBF16PS's), scaled once per block into fp32 sums, once per column at the end.
//
// Why: a decode step streams every weight once, and at one byte a weight it streams half the bf16 bytes; at batch 16
// the integer dot product does twice the bf16 one's products an instruction. The quality cost is measured in
// docs/BENCHMARKS.md (perplexity against bf16).
//
// Layout (server/models/int8_linear.py packs it): per panel of 32 columns, for each run of 4 inputs (k .. k+3) the
// 32 columns' 4 weights side by side as unsigned bytes q + 128, [K/4][32][4] (one 64-byte load: 16 columns x 4
// inputs, VPDPBUSD's unsigned operand), then the 32 columns' fp32 scales: K·32 + 128 bytes a panel. The + 128 is
// taken back per block from x's side: Σ r (q + 128) = Σ r q + 128 Σ r, and 128 Σ r is one number per row and block.
//
// On CPUs without AVX512-VNNI but with AVX2 (x86-64-v3: the AVX2 Xeons and EPYCs, Skylake-SP's AVX-512 without VNNI)
// the same panels and sums go through VPMADDUBSW: unsigned |r| times the weight given r's sign (VPSIGNB, after the
// + 128 is flipped off) in pairs, then VPMADDWD by ones into the 4-input sums; |r| and |q| <= 127, so no pair of
// products reaches the int16 limit. Same exact block sums, 8 columns a vector, fp32 activations only.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panel_parts.h"
#include "row_stores.h"
#include "work_split.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define NEURONMM_INT8 512
#elif defined(__AVX2__) && defined(__FMA__)
#define NEURONMM_INT8 256
#endif

#ifdef NEURONMM_INT8
#include <immintrin.h>

#include <memory>
#include <vector>

namespace {

using neuronmm::PanelList;
using neuronmm::Part;
#if NEURONMM_INT8 == 512
using neuronmm::store_row;
#else
using neuronmm::store8;
#endif

constexpr int64_t kBlock = 64;        // inputs of x per scale
constexpr int64_t kQuads = kBlock / 4;  // 4-input steps a block
constexpr int64_t kItemRows = 48;     // rows of x per work item (a panel stays in L1/L2 across its tiles)
constexpr int64_t kAheadQuads = 16;   // 4-input steps prefetched ahead into L1 (16 x 128 B)
constexpr int64_t kFarQuads = 64;     // and, by a tile that reads its panel in one pass, into L2 (8 KB)

// Rows of x quantised: r [M][K] int8, per row and block its scale s_b and 128 Σ r.
struct QuantRows {
  int8_t* r;
  float* scale;
  int32_t* offset;
  int64_t K;
  QuantRows at(int64_t m) const { return {r + m * K, scale + m * (K / kBlock), offset + m * (K / kBlock), K}; }
};

// Owns the storage of QuantRows.
struct QuantBuffer {
  std::vector<int8_t> r;
  std::vector<float> scale;
  std::vector<int32_t> offset;

  QuantRows rows(int64_t M, int64_t K) {
    r.resize(M * K);
    scale.resize(M * K / kBlock);
    offset.resize(M * K / kBlock);
    return {r.data(), scale.data(), offset.data(), K};
  }
};

#if NEURONMM_INT8 == 512
constexpr int64_t kTileRows = 6;  // rows of x per register tile: 2 x 6 int32 block sums, 2 x 6 fp32 sums

// 16 values of x as fp32.
inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x) {
  const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}

// One row of x per 64 inputs: s = max |x| / 127, r = round(x · (127 / max |x|)) (to nearest, ties to even; all zero
// where the block is), as int8_linear.quantize_rows_ref computes it.
template <typename X>
void quantize_row(const X* x, const QuantRows& out) {
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t b = 0; b < out.K / kBlock; ++b) {
    __m512 v[4];
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load16(x + b * kBlock + 16 * i);
      amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, v[i]));
    }
    const float peak = _mm512_reduce_max_ps(amax);
    const __m512 inv = _mm512_set1_ps(peak > 0.0f ? 127.0f / peak : 0.0f);
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const __m512i r = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], inv));
      sum = _mm512_add_epi32(sum, r);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out.r + b * kBlock + 16 * i), _mm512_cvtepi32_epi8(r));
    }
    out.scale[b] = peak / 127.0f;
    out.offset[b] = 128 * _mm512_reduce_add_epi32(sum);
  }
}

template <typename X>
void quantize_rows(const X* x, int64_t ldx, int64_t M, const QuantRows& out) {
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, out.at(m));
}

// MT rows of quantised x against one panel; writes the first `valid` of its 32 columns of y (row stride ldy).
// single_pass: the tile is the only one reading this panel, so it also prefetches the stream far ahead into L2.
template <int MT, typename Y>
inline void tile(const QuantRows& x, const uint8_t* panel, Y* y, int64_t ldy, int64_t valid, bool single_pass) {
  const int64_t K = x.K, blocks = K / kBlock;
  __m512 lo[MT], hi[MT];
  for (int j = 0; j < MT; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x.r);  // 4 inputs of a row of x are one int32
  for (int64_t b = 0; b < blocks; ++b) {
    __m512i ilo[MT], ihi[MT];
    for (int j = 0; j < MT; ++j) ilo[j] = ihi[j] = _mm512_setzero_si512();
    for (int64_t kq = b * kQuads; kq < (b + 1) * kQuads; ++kq) {
      const uint8_t* w = panel + kq * 128;
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadQuads * 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadQuads * 128 + 64), _MM_HINT_T0);
      if (single_pass) {
        _mm_prefetch(reinterpret_cast<const char*>(w + kFarQuads * 128), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(w + kFarQuads * 128 + 64), _MM_HINT_T1);
      }
      const __m512i w0 = _mm512_loadu_si512(w), w1 = _mm512_loadu_si512(w + 64);
      for (int j = 0; j < MT; ++j) {
        const __m512i xv = _mm512_set1_epi32(x4[j * K / 4 + kq]);
        ilo[j] = _mm512_dpbusd_epi32(ilo[j], w0, xv);
        ihi[j] = _mm512_dpbusd_epi32(ihi[j], w1, xv);
      }
    }
    for (int j = 0; j < MT; ++j) {  // the block's exact sums, less x's share of the + 128, in its scale
      const __m512i offset = _mm512_set1_epi32(x.offset[j * blocks + b]);
      const __m512 scale = _mm512_set1_ps(x.scale[j * blocks + b]);
      lo[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ilo[j], offset)), scale, lo[j]);
      hi[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(ihi[j], offset)), scale, hi[j]);
    }
  }
  const float* column_scale = reinterpret_cast<const float*>(panel + K * 32);
  const __m512 slo = _mm512_loadu_ps(column_scale), shi = _mm512_loadu_ps(column_scale + 16);
  for (int j = 0; j < MT; ++j) store_row(y + j * ldy, _mm512_mul_ps(lo[j], slo), _mm512_mul_ps(hi[j], shi), valid);
}

template <int MT, typename Y>
void tile_of(const QuantRows& x, const uint8_t* panel, Y* y, int64_t ldy, int64_t valid, int64_t rows, bool single) {
  if constexpr (MT > 0) {
    if (rows == MT) return tile<MT>(x, panel, y, ldy, valid, single);
    tile_of<MT - 1>(x, panel, y, ldy, valid, rows, single);
  }
}

// `rows` rows of quantised x against one panel, a register tile of up to kTileRows rows at a time.
template <typename Y>
void panel_rows(const QuantRows& x, const uint8_t* panel, Y* y, int64_t ldy, int64_t valid, int64_t rows) {
  const bool single = rows <= kTileRows;
  for (int64_t m = 0; m < rows; m += kTileRows)
    tile_of<kTileRows>(x.at(m), panel, y + m * ldy, ldy, valid, std::min(kTileRows, rows - m), single);
}

#else  // AVX2: 8 columns a vector
constexpr int64_t kTileRows = 2;  // rows of x per register tile over half a panel: 2 x 2 int32 block sums, 2 x 2 fp32

inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}

// As the AVX-512 quantize_row, 8 values at a time (the same scales and codes: max and rounding are exact).
void quantize_row(const float* x, const QuantRows& out) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t b = 0; b < out.K / kBlock; ++b) {
    __m256 v[8];
    __m256 amax = _mm256_setzero_ps();
    for (int i = 0; i < 8; ++i) {
      v[i] = _mm256_loadu_ps(x + b * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    const float peak = max8(amax);
    const __m256 inv = _mm256_set1_ps(peak > 0.0f ? 127.0f / peak : 0.0f);
    int32_t sum = 0;
    for (int i = 0; i < 8; ++i) {
      alignas(32) int32_t r[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(r), _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv)));
      for (int j = 0; j < 8; ++j) {
        out.r[b * kBlock + 8 * i + j] = int8_t(r[j]);
        sum += r[j];
      }
    }
    out.scale[b] = peak / 127.0f;
    out.offset[b] = 128 * sum;  // (the AVX2 tiles take the + 128 off the weights instead)
  }
}

template <typename X>
void quantize_rows(const X* x, int64_t ldx, int64_t M, const QuantRows& out) {
  for (int64_t m = 0; m < M; ++m) quantize_row(x + m * ldx, out.at(m));
}

// MT rows of quantised x against half a panel (columns 16 h .. 16 h + 15); writes the first `valid` of them.
template <int MT>
inline void tile(const QuantRows& x, const uint8_t* panel, int h, float* y, int64_t ldy, int64_t valid, bool single) {
  const int64_t K = x.K, blocks = K / kBlock;
  const __m256i flip = _mm256_set1_epi8(int8_t(0x80)), ones = _mm256_set1_epi16(1);
  __m256 lo[MT], hi[MT];
  for (int j = 0; j < MT; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  const int32_t* x4 = reinterpret_cast<const int32_t*>(x.r);
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i ilo[MT], ihi[MT];
    for (int j = 0; j < MT; ++j) ilo[j] = ihi[j] = _mm256_setzero_si256();
    for (int64_t kq = b * kQuads; kq < (b + 1) * kQuads; ++kq) {
      const uint8_t* w = panel + kq * 128 + h * 64;
      _mm_prefetch(reinterpret_cast<const char*>(w + kAheadQuads * 128), _MM_HINT_T0);
      if (single) _mm_prefetch(reinterpret_cast<const char*>(w + kFarQuads * 128), _MM_HINT_T1);
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 32)), flip);
      for (int j = 0; j < MT; ++j) {
        const __m256i xv = _mm256_set1_epi32(x4[j * K / 4 + kq]), ax = _mm256_abs_epi8(xv);
        ilo[j] = _mm256_add_epi32(ilo[j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w0, xv)), ones));
        ihi[j] = _mm256_add_epi32(ihi[j], _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(w1, xv)), ones));
      }
    }
    for (int j = 0; j < MT; ++j) {
      const __m256 scale = _mm256_set1_ps(x.scale[j * blocks + b]);
      lo[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ilo[j]), scale, lo[j]);
      hi[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ihi[j]), scale, hi[j]);
    }
  }
  const float* column_scale = reinterpret_cast<const float*>(panel + K * 32) + 16 * h;
  const __m256 slo = _mm256_loadu_ps(column_scale), shi = _mm256_loadu_ps(column_scale + 8);
  for (int j = 0; j < MT; ++j) {
    store8(y + j * ldy, _mm256_mul_ps(lo[j], slo), valid);
    store8(y + j * ldy + 8, _mm256_mul_ps(hi[j], shi), valid - 8);
  }
}

template <int MT>
void tile_of(const QuantRows& x, const uint8_t* panel, int h, float* y, int64_t ldy, int64_t valid, int64_t rows,
             bool single) {
  if constexpr (MT > 0) {
    if (rows == MT) return tile<MT>(x, panel, h, y, ldy, valid, single);
    tile_of<MT - 1>(x, panel, h, y, ldy, valid, rows, single);
  }
}

// `rows` rows of quantised x against one panel: each half panel against every register tile of rows in turn.
template <typename Y>
void panel_rows(const QuantRows& x, const uint8_t* panel, Y* y, int64_t ldy, int64_t valid, int64_t rows) {
  const bool single = rows <= kTileRows;
  for (int h = 0; h < (valid > 16 ? 2 : 1); ++h)
    for (int64_t m = 0; m < rows; m += kTileRows)
      tile_of<kTileRows>(x.at(m), panel, h, y + m * ldy + 16 * h, ldy, valid - 16 * h, std::min(kTileRows, rows - m),
                         single);
}
#endif  // NEURONMM_INT8 == 512

template <typename X>
using Parts = std::vector<Part<X, uint8_t, X>>;

// Decode sizes (one row block): the panels split between the threads as in the other kernels, each thread
// quantising the x of the parts it works on into its own buffer (the x of a factored call's second GEMM is written
// by the first inside the same region).
template <typename X>
auto one_block_phase(const Parts<X>& parts, const PanelList& list, int64_t M) {
  return neuronmm::phase(list.panels(), [&list](int64_t p) { return list.cost_before(p); },
                         [&parts, &list, M](const auto& next) {
    thread_local QuantBuffer buffer;
    QuantRows rows{};
    const X* quantised = nullptr;  // the x `rows` holds (the parts of a first GEMM share one)
    int64_t quantised_k = 0;
    for (int64_t p; next(p);) {
      const size_t i = list.part_of(p);
      const auto& q = parts[i];
      if (quantised != q.x || quantised_k != q.K) {
        rows = buffer.rows(M, q.K);
        quantize_rows(q.x, q.ldx, M, rows);
        quantised = q.x;
        quantised_k = q.K;
      }
      const int64_t lp = p - list.first[i];
      panel_rows(rows, q.panels + lp * neuronmm::panel_elems<uint8_t>(q.K), q.y + lp * 32, q.ldy, q.N - lp * 32, M);
    }
  });
}

// Prefill sizes: every part's x quantised once (rows split between the threads), then (panel, row block) items.
template <typename X>
void many_rows(const Parts<X>& parts, int64_t M) {
  std::vector<QuantBuffer> buffers(parts.size());
  std::vector<QuantRows> rows(parts.size());
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& q = parts[i];
    const bool same_x = i > 0 && q.x == parts[i - 1].x && q.ldx == parts[i - 1].ldx && q.K == parts[i - 1].K;
    if (same_x) {
      rows[i] = rows[i - 1];
      continue;
    }
    rows[i] = buffers[i].rows(M, q.K);
    at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
      quantize_rows(q.x + b * q.ldx, q.ldx, e - b, rows[i].at(b));
    });
  }
  const PanelList list(parts);
  const int64_t blocks = (M + kItemRows - 1) / kItemRows;
  neuronmm::balanced_for(
      list.panels() * blocks,
      [&list, blocks](int64_t item) {
        const int64_t p = item / blocks, rb = item % blocks;
        return list.cost_before(p) * blocks + rb * list.cost_of(p);
      },
      [&](const auto& next) {
        for (int64_t item; next(item);) {
          const int64_t p = item / blocks, m = item % blocks * kItemRows;
          const size_t i = list.part_of(p);
          const auto& q = parts[i];
          const int64_t lp = p - list.first[i];
          panel_rows(rows[i].at(m), q.panels + lp * neuronmm::panel_elems<uint8_t>(q.K), q.y + m * q.ldy + lp * 32,
                     q.ldy, q.N - lp * 32, std::min(kItemRows, M - m));
        }
      });
}

template <typename X>
void run_int8(const Parts<X>& parts, int64_t M) {
  if (M > kItemRows) return many_rows(parts, M);
  const PanelList list(parts);
  const auto work = one_block_phase(parts, list, M);
  neuronmm::balanced_for(work.count, work.cost_before, work.body);
}

template <typename X>
void run_int8_then(const Parts<X>& first, const Parts<X>& second, int64_t M) {
  if (M > kItemRows) {
    run_int8(first, M);
    return run_int8(second, M);
  }
  const PanelList one(first), two(second);
  neuronmm::balanced_for_then(one_block_phase(first, one, M), one_block_phase(second, two, M));
}

void check_panels(const at::Tensor& panels, int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(K % kBlock == 0, op, ": int8 panels need K a multiple of ", kBlock, ", got ", K);
  TORCH_CHECK(panels.dim() == 2 && panels.scalar_type() == at::kByte &&
                  panels.size(1) == neuronmm::panel_elems<uint8_t>(K) && panels.size(0) * 32 >= N &&
                  panels.is_contiguous(),
              op, ": int8 panels [ceil(N/32), K * 32 + 128] (uint8) from int8_linear.pack_int8_panels expected");
}

template <typename X>
at::Tensor linear(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto y = at::empty({M, N}, xc.options());
  run_int8<X>({{xc.data_ptr<X>(), K, panels.data_ptr<uint8_t>(), K, N, y.data_ptr<X>(), N}}, M);
  return y;
}

at::Tensor panel_linear_int8(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "panel_linear_int8: x [M, K] expected");
  check_panels(panels, x.size(1), N, "panel_linear_int8");
  if (x.scalar_type() == at::kFloat) return linear<float>(x, panels, N);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) return linear<at::BFloat16>(x, panels, N);
#endif
  TORCH_CHECK(false, "panel_linear_int8: fp32 x (or bf16 on a CPU with AVX512-BF16) expected");
}

}  // namespace

void neuronmm::factored_linear_int8(const at::Tensor& x, const at::Tensor& first, at::IntArrayRef splits,
                                    const c10::List<std::optional<at::Tensor>>& seconds, at::IntArrayRef outs,
                                    at::Tensor& y, const at::Tensor& scratch) {
  if (x.scalar_type() == at::kFloat)
    return factored_impl<float, uint8_t>(x, first, splits, seconds, outs, y, scratch, run_int8<float>,
                                         run_int8_then<float>, check_panels);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16)
    return factored_impl<at::BFloat16, uint8_t>(x, first, splits, seconds, outs, y, scratch, run_int8<at::BFloat16>,
                                                run_int8_then<at::BFloat16>, check_panels);
#endif
  TORCH_CHECK(false, "factored_linear (int8 panels): fp32 x (or bf16 on a CPU with AVX512-BF16) expected");
}

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.def("panel_linear_int8(Tensor x, Tensor panels, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) {
  m.impl("panel_linear_int8", &panel_linear_int8);
}

#else
void neuronmm::factored_linear_int8(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                    const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef, at::Tensor&,
                                    const at::Tensor&) {
  TORCH_CHECK(false, "factored_linear: int8 panels need AVX512-VNNI or AVX2, which this build lacks");
}
#endif  // NEURONMM_INT8
