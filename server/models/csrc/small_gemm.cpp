// Panel GEMMs for a decode step's linears: y[M, N] = x[M, K] · Wᵀ, W [N, K] held in a panel layout; bf16 first, fp32 below.
// fp32 accumulation, each output rounded once to bf16 (as oneDNN's bf16 GEMM rounds it).
//
// Why: at a decode step every weight is read once from DRAM for a handful of rows, so a linear should
// run at memory bandwidth. oneDNN's packed bf16 GEMM spends ~20 µs a call on dispatch and setup, which
// on the 0.6-3.5 MB matrices of a small model is as long as reading the matrix; this kernel does no
// work but the products.
//
// Layout (pack_panels): W is cut into panels of 32 output columns; a panel holds, for each pair of
// input positions (k, k+1), the 32 columns' two values side by side: [N/32][K/2][32][2] bf16, N padded
// to a multiple of 32 with zero columns. One 64-byte load then gives 16 columns x 2 inputs, which
// VDPBF16PS multiplies by a broadcast pair of x and adds into 16 fp32 sums: no horizontal reductions,
// and a panel is read front to back, a single stream for the hardware prefetcher. With more rows of x than
// the loader's thresholds (gemm_tuning.py), the same panels go through fp32 FMAs instead (tile_fma) or, on
// CPUs with AMX, through tile products (tile_amx): the layout is already AMX's B-tile format.
// Register tile: up to 12 rows of x x one panel (24 accumulators); AMX: up to 32 rows x one panel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "panel_parts.h"
#include "row_stores.h"
#include "step_ops.h"
#include "work_split.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

using neuronmm::PanelList;
using neuronmm::Part;
using neuronmm::Runner;
using neuronmm::RunnerThen;
using neuronmm::factored_impl;
#if defined(__AVX512F__)
using neuronmm::store_row;
#endif
#if defined(__AVX2__)
using neuronmm::store8;
#endif

constexpr int64_t kMaxRows = 12;  // rows of x per register tile (both dtypes: 2 x 12 accumulators)
constexpr int64_t kRowsPerItem = 4 * kMaxRows;  // rows of x per work item (a panel stays in L1/L2 across them)

// Nothing to set up or tear down around a thread's share of a GEMM (the vector kernels need nothing).
struct NoScope {};

// One [M, K] x panels GEMM as a balanced_for phase that calls tile(panel, first row, rows). Work items are (panel, row block) pairs,
// panel-major, split by cost (neuronmm::balanced_for: splitting by cost rather than count matters when parts
// differ in K: gate at rank 128 beside up at rank 256 gave one thread a third of the work, the other two): at
// decode sizes (one row block) each thread streams its own part of the weight once; at prefill sizes a matrix
// with few panels still spreads over every thread. A row block (ItemRows) is cut into tiles of up to TileRows
// rows; a Scope lives across each thread's share (AMX configures its tiles there).
template <int64_t ItemRows, int64_t TileRows, typename Scope, typename Tile>
auto tile_phase(int64_t M, const PanelList& list, const Tile& tile) {
  const int64_t row_blocks = (M + ItemRows - 1) / ItemRows;
  return neuronmm::phase(
      list.panels() * row_blocks,
      [&list, row_blocks](int64_t item) {  // row blocks of a panel cost alike
        const int64_t p = item / row_blocks, rb = item % row_blocks;
        return list.cost_before(p) * row_blocks + (rb == 0 ? 0 : rb * list.cost_of(p));
      },
      [&tile, row_blocks, M](const auto& next) {
        [[maybe_unused]] const Scope scope;
        for (int64_t item; next(item);) {
          const int64_t p = item / row_blocks, m_end = std::min(M, (item % row_blocks + 1) * ItemRows);
          for (int64_t m = (item % row_blocks) * ItemRows; m < m_end; m += TileRows)
            tile(p, m, std::min(TileRows, m_end - m));
        }
      });
}

// A list of parts' tiles: rows(x, ldx, panel, y, ldy, valid_columns, K, num_rows) computes one.
template <typename X, typename T, typename Y, typename Rows>
auto part_tiles(const std::vector<Part<X, T, Y>>& parts, const PanelList& list, const Rows& rows) {
  return [&parts, &list, &rows](int64_t p, int64_t m, int64_t n) {
    const size_t i = list.part_of(p);
    const Part<X, T, Y>& q = parts[i];
    const int64_t lp = p - list.first[i];
    rows(q.x + m * q.ldx, q.ldx, q.panels + lp * neuronmm::panel_elems<T>(q.K), q.y + m * q.ldy + lp * 32, q.ldy,
         q.N - lp * 32, q.K, n);
  };
}

// All parts' panels as one work list in one parallel region; `rows` computes one tile:
// rows(x, ldx, panel, y, ldy, valid_columns, K, num_rows).
template <int64_t ItemRows = kRowsPerItem, int64_t TileRows = kMaxRows, typename Scope = NoScope, typename X,
          typename T, typename Y, typename Rows>
void gemm_parts(const std::vector<Part<X, T, Y>>& parts, int64_t M, const Rows& rows) {
  const PanelList list(parts);
  const auto tiles = part_tiles(parts, list, rows);
  const auto work = tile_phase<ItemRows, TileRows, Scope>(M, list, tiles);
  neuronmm::balanced_for(work.count, work.cost_before, work.body);
}

// gemm_parts(first), then gemm_parts(second) (which may read first's output), in one parallel region.
template <int64_t ItemRows = kRowsPerItem, int64_t TileRows = kMaxRows, typename Scope = NoScope, typename X,
          typename T, typename Y, typename Rows>
void gemm_parts_then(const std::vector<Part<X, T, Y>>& first, const std::vector<Part<X, T, Y>>& second, int64_t M,
                     const Rows& rows) {
  const PanelList one(first), two(second);
  const auto tiles_one = part_tiles(first, one, rows), tiles_two = part_tiles(second, two, rows);
  neuronmm::balanced_for_then(tile_phase<ItemRows, TileRows, Scope>(M, one, tiles_one),
                              tile_phase<ItemRows, TileRows, Scope>(M, two, tiles_two));
}

// A panel that takes several register-tile passes is read from DRAM by the first and from L1/L2 by the others,
// and DRAM would idle while those compute. So each pass also prefetches its share of the part's next panel into
// L2, spread evenly over the pass's k steps (one line every `stride` steps), and the stream goes on under the
// arithmetic. A single pass needs none: it is the stream. (AVX2 fp32, 16 rows: batch-16 step 61.4 -> 55.8 ms with
// a line every step; spreading the AVX2 tile's six passes' lines over all their steps: the step's GEMMs 43 -> 38 ms.)
// Why spread: a line requested from DRAM holds a fill buffer until it arrives, and a core has few of them; a pass
// that asked for its share in a burst left the core waiting for buffers, then the DRAM idle for the rest.

// One tile pass's share of the next panel: `lines` lines from `at`, one every `stride` k steps.
struct PassShare {
  const char* at = nullptr;
  int64_t lines = 0, stride = 1;
};

class NextPanel {
 public:
  // `lines` of the next panel over `passes` passes of `steps` k steps each (at most a line a step)
  NextPanel(const void* next, int64_t lines, int64_t passes, int64_t steps)
      : base_(passes > 1 ? static_cast<const char*>(next) : nullptr),
        lines_(lines),
        share_(std::min(steps, (lines + passes - 1) / passes)),
        stride_(std::max<int64_t>(1, steps / std::max<int64_t>(1, share_))) {}
  // what pass i prefetches
  PassShare pass(int64_t i) const {
    const int64_t n = base_ ? std::clamp<int64_t>(lines_ - i * share_, 0, share_) : 0;
    return n ? PassShare{base_ + i * share_ * 64, n, stride_} : PassShare{};
  }

 private:
  const char* base_;  // nullptr: the part has no next panel, or the panel takes one pass
  int64_t lines_, share_, stride_;
};

// Walks a pass's share through its tile loop: step(k) at every k step prefetches the line due then (locality 2:
// into L2, prefetcht1). Ahead: whether the loop prefetches the next panel at all; a compile-time choice, so
// single-pass calls (the memory-bound decode sizes) run the loop they ran before.
// always_inline: GCC must see the prefetch in the loop (a prefetch-only call out of line can be deleted as pure).
template <bool Ahead>
class L2Ahead {
 public:
  explicit L2Ahead(const PassShare& share) : share_(share) {}
  __attribute__((always_inline)) void step(int64_t k) {
    if constexpr (Ahead)
      if (k == due_ && line_ < share_.lines) {
        __builtin_prefetch(share_.at + 64 * line_++, 0, 2);
        due_ += share_.stride;
      }
  }

 private:
  PassShare share_;
  int64_t due_ = 0, line_ = 0;
};

// A row block of `rows` against one panel in register tiles of up to TileRows rows: tile(m, n, share, ahead) per
// tile, `ahead` a std::bool_constant saying whether it prefetches its share of the next panel (only when the block
// takes several tiles). Even: tiles of as equal a height as can be (16 rows: 8 + 8), else full tiles and a short
// last one (12 + 4): each caller takes the split its tiles run faster with.
template <int64_t TileRows, bool Even = false, typename Tile>
inline void tile_row_block(int64_t rows, const NextPanel& next, const Tile& tile) {
  if (rows <= TileRows) return tile(0, rows, PassShare{}, std::false_type{});
  const int64_t tiles = (rows + TileRows - 1) / TileRows;
  for (int64_t m = 0, i = 0; i < tiles; ++i) {
    const int64_t n = Even ? rows / tiles + (i < rows % tiles) : std::min(TileRows, rows - m);
    tile(m, n, next.pass(i), std::true_type{});
    m += n;
  }
}

// y [M, N] = x · Wᵀ for one panel-packed weight (dtype and panel layout checked by the caller).
template <typename T, typename W = T>
at::Tensor linear_of(const at::Tensor& x, const at::Tensor& panels, int64_t N, Runner<T, W> run) {
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1);
  auto y = at::empty({M, N}, xc.options());
  run({{xc.data_ptr<T>(), K, panels.data_ptr<W>(), K, N, y.data_ptr<T>(), N}}, M);
  return y;
}

}  // namespace

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <cstring>

namespace {

constexpr int64_t kPanel = 32;    // output columns per panel (two zmm of fp32 sums)
constexpr int64_t kAhead = 16;    // pairs of input positions prefetched ahead (16 x 128 B)

// W [N, K] bf16 -> panels [ceil(N/32), K/2, 32, 2] (zero-padded columns).
at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_panels: bf16 weight [N, K] expected");
  TORCH_CHECK(weight.size(1) % 2 == 0, "pack_panels: K must be even");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanel - 1) / kPanel;
  auto out = at::zeros({panels, K / 2, kPanel, 2}, w.options());
  const auto* src = w.data_ptr<at::BFloat16>();
  auto* dst = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < kPanel && p * kPanel + c < N; ++c)
        for (int64_t k = 0; k < K; ++k)
          dst[((p * (K / 2) + k / 2) * kPanel + c) * 2 + k % 2] = src[(p * kPanel + c) * K + k];
  });
  return out;
}

// A tile that reads its panel in a single pass also prefetches it 64 pairs (8 KB) ahead into L2, for the reason
// prefetch_single_pass gives for the fp32 tiles. A step's linears, alternating in one process: 1 row 1.11 x
// (VDPBF16PS, native build); under the EPYC-class caps (AVX512-BF16, no AMX) 1.10 x at 1 row, 1.20-1.22 x at 2-4,
// 1.12 x at 8, 1.04 x at 12 (fp32 FMAs from 4 rows there), 0.99 x at 16 (two passes: no far prefetch).
constexpr int64_t kFarPairs = 64;

// Prefetches the two lines of pair kp + Distance of a panel into L1 (_MM_HINT_T0) or L2 (_MM_HINT_T1).
template <int64_t Distance, decltype(_MM_HINT_T0) Locality>
__attribute__((always_inline)) inline void prefetch_pair(const at::BFloat16* panel, int64_t kp) {
  const char* pair = reinterpret_cast<const char*>(panel + (kp + Distance) * 2 * kPanel);
  _mm_prefetch(pair, Locality);
  _mm_prefetch(pair + 64, Locality);
}

template <bool Ahead>
__attribute__((always_inline)) inline void prefetch_pairs_single_pass(const at::BFloat16* panel, int64_t kp) {
  if constexpr (!Ahead) prefetch_pair<kFarPairs, _MM_HINT_T1>(panel, kp);
}

// MT rows of x (row stride ldx, even) against one panel; writes the first `valid` of its 32 columns of y.
template <int MT, bool Ahead>
inline void tile(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
                 int64_t valid, int64_t K, const PassShare& next) {
  __m512 lo[MT], hi[MT];
  for (int j = 0; j < MT; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
  const int32_t* xp = reinterpret_cast<const int32_t*>(x);  // a (k, k+1) pair of x is one int32
  const int64_t pairs = K / 2, stride = ldx / 2;             // row stride of x, in pairs
  L2Ahead<Ahead> ahead(next);
  for (int64_t kp = 0; kp < pairs; ++kp) {
    // Software prefetch 2 KB ahead: the stream prefetcher alone left ~25 % of the DRAM bandwidth unused.
    prefetch_pair<kAhead, _MM_HINT_T0>(panel, kp);
    prefetch_pairs_single_pass<Ahead>(panel, kp);
    ahead.step(kp);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + kp * 2 * kPanel + kPanel);
    for (int j = 0; j < MT; ++j) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(xp[j * stride + kp]);
      lo[j] = _mm512_dpbf16_ps(lo[j], w0, xv);
      hi[j] = _mm512_dpbf16_ps(hi[j], w1, xv);
    }
  }
  for (int j = 0; j < MT; ++j) store_row(y + j * ldy, lo[j], hi[j], valid);
}

template <int MT, bool Ahead>
void rows_of(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
             int64_t valid, int64_t K, int64_t rows, const PassShare& next) {
  if constexpr (MT > 0) {
    if (rows == MT) return tile<MT, Ahead>(x, ldx, panel, y, ldy, valid, K, next);
    rows_of<MT - 1, Ahead>(x, ldx, panel, y, ldy, valid, K, rows, next);
  }
}

// A bf16 panel is K lines of 64 B; a tile pass takes K / 2 steps.
inline NextPanel next_bf16_panel(const at::BFloat16* panel, int64_t valid, int64_t K, int64_t rows) {
  return {valid > kPanel ? panel + K * kPanel : nullptr, K, (rows + kMaxRows - 1) / kMaxRows, K / 2};
}

// A row block against one panel, a register tile of up to kMaxRows rows at a time.
const auto bf16_rows = [](const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
                          int64_t valid, int64_t K, int64_t rows) {
  tile_row_block<kMaxRows>(rows, next_bf16_panel(panel, valid, K, rows),
                           [&](int64_t m, int64_t n, const PassShare& next, auto ahead) {
    rows_of<kMaxRows, decltype(ahead)::value>(x + m * ldx, ldx, panel, y + m * ldy, ldy, valid, K, n, next);
  });
};

// The same panels through fp32 FMAs: a 64-byte load holds 16 columns x (k, k+1); shifting each 32-bit lane
// left by 16 gives the 16 columns' fp32 values at k, masking its low half gives them at k+1 (bf16 is the top
// half of an fp32). x comes in fp32 (widened by the caller). Products and sums are exact-input fp32 FMAs, so
// the result differs from the VDPBF16PS path only in rounding.
template <int MT, bool Ahead>
inline void tile_fma(const float* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
                     int64_t valid, int64_t K, const PassShare& next) {
  __m512 lo[MT], hi[MT];
  for (int j = 0; j < MT; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
  const __m512i top = _mm512_set1_epi32(int32_t(0xFFFF0000u));
  L2Ahead<Ahead> ahead(next);
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    prefetch_pair<kAhead, _MM_HINT_T0>(panel, kp);
    prefetch_pairs_single_pass<Ahead>(panel, kp);
    ahead.step(kp);
    const __m512i a = _mm512_loadu_si512(panel + kp * 2 * kPanel);
    const __m512i b = _mm512_loadu_si512(panel + kp * 2 * kPanel + kPanel);
    const __m512 a0 = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), a1 = _mm512_castsi512_ps(_mm512_and_si512(a, top));
    const __m512 b0 = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), b1 = _mm512_castsi512_ps(_mm512_and_si512(b, top));
    for (int j = 0; j < MT; ++j) {
      const __m512 x0 = _mm512_set1_ps(x[j * ldx + 2 * kp]), x1 = _mm512_set1_ps(x[j * ldx + 2 * kp + 1]);
      lo[j] = _mm512_fmadd_ps(x1, a1, _mm512_fmadd_ps(x0, a0, lo[j]));
      hi[j] = _mm512_fmadd_ps(x1, b1, _mm512_fmadd_ps(x0, b0, hi[j]));
    }
  }
  for (int j = 0; j < MT; ++j) store_row(y + j * ldy, lo[j], hi[j], valid);
}

template <int MT, bool Ahead>
void rows_fma(const float* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy, int64_t valid,
              int64_t K, int64_t rows, const PassShare& next) {
  if constexpr (MT > 0) {
    if (rows == MT) return tile_fma<MT, Ahead>(x, ldx, panel, y, ldy, valid, K, next);
    rows_fma<MT - 1, Ahead>(x, ldx, panel, y, ldy, valid, K, rows, next);
  }
}

const auto bf16_fma_rows = [](const float* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
                              int64_t valid, int64_t K, int64_t rows) {
  tile_row_block<kMaxRows>(rows, next_bf16_panel(panel, valid, K, rows),
                           [&](int64_t m, int64_t n, const PassShare& next, auto ahead) {
    rows_fma<kMaxRows, decltype(ahead)::value>(x + m * ldx, ldx, panel, y + m * ldy, ldy, valid, K, n, next);
  });
};

// dst[0..n) = src[0..n) in fp32 (bf16 is the top half of an fp32: a zero-extend and a shift per 16 values)
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i)));
    _mm512_storeu_ps(dst + i, _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)));
  }
  for (; i < n; ++i) dst[i] = float(src[i]);
}

// ---- AMX (Sapphire Rapids and later) -----------------------------------------------------------------
// The panel layout is already AMX's B-tile format: with a 128-byte row stride, rows kp .. kp+15 of a panel's
// first (or second) 64 bytes per pair are one tile of 16 input pairs x 16 columns. TDPBF16PS multiplies a tile
// of up to 16 rows x 32 inputs of x by such a tile into 16 x 16 fp32 sums: 16 x the products of one VDPBF16PS,
// so from a few rows on the GEMM streams the weight at memory speed where the vector paths are compute-bound.
// Sums are fp32 and each output is rounded once to bf16, as in the other paths (the pair products are added in
// another order than VDPBF16PS adds them, so results differ from it in rounding only).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define NEURONMM_AMX 1
#include <sys/syscall.h>
#include <unistd.h>

constexpr int64_t kTileK = 32;        // inputs per tile step (16 pairs: a 64-byte tile row)
constexpr int64_t kAmxTileRows = 32;  // rows of x per call of the tile kernel: two A tiles share each B tile
constexpr int64_t kAmxAhead = 3;      // tile steps of the panel prefetched ahead (into L2: tile_amx)

// Linux hands out AMX's 8 KB of tile state only on request, once per process.
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

// LDTILECFG's 64-byte operand (palette 1).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0-1 sums of x rows 0-15 (columns 0-15, 16-31), 2-3 the same for rows 16-31, 4-5 those rows of x,
// 6-7 the panel's two column halves. The shapes depend on the row count alone, so a thread configures them
// when it changes; AmxScope releases them at the end of the thread's stretch (other code, oneDNN's AMX GEMMs,
// configures tiles on the same threads, so nothing is assumed across calls).
thread_local int64_t t_configured_rows = 0;

void configure_tiles(int64_t rows) {
  if (rows == t_configured_rows) return;
  TileConfig cfg;
  const int64_t upper = std::min<int64_t>(rows, 16), lower = rows - upper;
  for (int t : {0, 1, 4}) cfg.rows[t] = uint8_t(upper), cfg.colsb[t] = 64;
  if (lower > 0)
    for (int t : {2, 3, 5}) cfg.rows[t] = uint8_t(lower), cfg.colsb[t] = 64;
  for (int t : {6, 7}) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
  t_configured_rows = rows;
}

struct AmxScope {
  AmxScope() { t_configured_rows = 0; }
  ~AmxScope() {
    if (t_configured_rows) _tile_release();
    t_configured_rows = 0;
  }
};

// Up to 32 rows of x (row stride ldx) against one panel, K a multiple of 32; writes `valid` of 32 columns of y.
template <bool TwoRowTiles>
inline void tile_amx(const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
                     int64_t valid, int64_t K, int64_t rows) {
  alignas(64) float sums[32 * 32];
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TwoRowTiles) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int64_t x_stride = ldx * int64_t(sizeof(at::BFloat16));
  for (int64_t k = 0; k < K; k += kTileK) {
    const at::BFloat16* w = panel + k * kPanel;  // k / 2 pairs of 64 values
    // The panel three steps ahead (2 KB a step), into L2: the tile loads read L2 at full speed, and a burst of 32
    // prefetches into L1 holds the core's few L1 fill buffers. Batch-16 decode steps, paired with the old two steps
    // into L1 (Xeon, Emerald Rapids): 1.024 x dense, 1.022 x SVD; two steps into L2 1.014 x; four the same as
    // three, eight slower; both an L1 and a far L2 prefetch 0.98 x of three into L2, every other line 0.92 x.
    for (int line = 0; line < 32; ++line)
      _mm_prefetch(reinterpret_cast<const char*>(w + kAmxAhead * kTileK * kPanel + line * 32), _MM_HINT_T1);
    _tile_loadd(6, w, 2 * kPanel * sizeof(at::BFloat16));
    _tile_loadd(7, w + kPanel, 2 * kPanel * sizeof(at::BFloat16));
    _tile_loadd(4, x + k, x_stride);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TwoRowTiles) {
      _tile_loadd(5, x + 16 * ldx + k, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 32 * sizeof(float));
  _tile_stored(1, sums + 16, 32 * sizeof(float));
  if constexpr (TwoRowTiles) {
    _tile_stored(2, sums + 16 * 32, 32 * sizeof(float));
    _tile_stored(3, sums + 16 * 32 + 16, 32 * sizeof(float));
  }
  for (int64_t j = 0; j < rows; ++j)
    store_row(y + j * ldy, _mm512_load_ps(sums + j * 32), _mm512_load_ps(sums + j * 32 + 16), valid);
}

const auto amx_rows = [](const at::BFloat16* x, int64_t ldx, const at::BFloat16* panel, at::BFloat16* y, int64_t ldy,
                         int64_t valid, int64_t K, int64_t rows) {
  configure_tiles(rows);
  if (rows > 16) return tile_amx<true>(x, ldx, panel, y, ldy, valid, K, rows);
  tile_amx<false>(x, ldx, panel, y, ldy, valid, K, rows);
};

// Whether every part's K is whole tile steps (the ranks and widths of this project's models are multiples of 32).
bool amx_fits(const std::vector<Part<at::BFloat16, at::BFloat16>>& parts) {
  return std::all_of(parts.begin(), parts.end(), [](const auto& q) { return q.K % kTileK == 0; });
}
#endif  // __AMX_TILE__ && __AMX_BF16__

// From how many rows of x the bf16 panel GEMMs use AMX (0: never). Set once by the loader, which times it
// against the vector paths on this CPU (gemm_tuning.py); only settable where AMX is built in and permitted.
std::atomic<int64_t> g_amx_min_rows{0};

// From how many rows of x the bf16 panel GEMMs multiply with fp32 FMAs instead of VDPBF16PS (0: never). Set
// once by the loader, which times both on this CPU: at one or two rows both stream the weight at memory
// bandwidth and the dot product's fewer instructions win; with more rows the GEMM is compute-bound and the
// faster instruction depends on the core (on the Xeons measured the FMA path is ~1.6 x faster from 4 rows).
std::atomic<int64_t> g_fma_min_rows{0};

// The FMA path at decode sizes (one row block): the panels are split between the threads as gemm_parts splits
// them, and each thread widens the x of the parts it works on into its own buffer. Widening once for all
// threads cost ~25 µs a call at K = 1536: the other thread then read every line of x from the core that
// wrote it.
auto fma_phase(const std::vector<Part<at::BFloat16, at::BFloat16>>& parts, const PanelList& list, int64_t M) {
  return neuronmm::phase(list.panels(), [&list](int64_t p) { return list.cost_before(p); }, [&parts, &list, M](const auto& next) {
    thread_local std::vector<float> wide;
    const at::BFloat16* widened = nullptr;  // the x that `wide` holds (parts of one call may share it)
    int64_t widened_k = 0;
    for (int64_t p; next(p);) {
      const size_t i = list.part_of(p);
      const auto& q = parts[i];
      if (widened != q.x || widened_k != q.K) {
        wide.resize(M * q.K);
        for (int64_t m = 0; m < M; ++m) widen(q.x + m * q.ldx, wide.data() + m * q.K, q.K);
        widened = q.x;
        widened_k = q.K;
      }
      const int64_t lp = p - list.first[i];
      bf16_fma_rows(wide.data(), q.K, q.panels + lp * q.K * 32, q.y + lp * 32, q.ldy, q.N - lp * 32, q.K, M);
    }
  });
}

void fma_one_row_block(const std::vector<Part<at::BFloat16, at::BFloat16>>& parts, int64_t M) {
  const PanelList list(parts);
  const auto work = fma_phase(parts, list, M);
  neuronmm::balanced_for(work.count, work.cost_before, work.body);
}

// The kernel a bf16 GEMM of M rows takes, by the loader's thresholds: AMX tiles (only where every part fits them),
// VDPBF16PS, or fp32 FMAs on x widened per thread (one row block) or once for all threads (more rows).
enum class Bf16Path { kAmx, kDot, kFmaOneBlock, kFmaWidened };

bool fits_amx(const std::vector<Part<at::BFloat16, at::BFloat16>>& parts) {
#ifdef NEURONMM_AMX
  return amx_fits(parts);
#else
  return false;  // a build without AMX
#endif
}

Bf16Path bf16_path(int64_t M, bool fits_amx) {
  const int64_t amx_from = g_amx_min_rows.load(std::memory_order_relaxed);
  if (fits_amx && amx_from > 0 && M >= amx_from) return Bf16Path::kAmx;
  const int64_t fma_from = g_fma_min_rows.load(std::memory_order_relaxed);
  if (fma_from == 0 || M < fma_from) return Bf16Path::kDot;
  return M <= kRowsPerItem ? Bf16Path::kFmaOneBlock : Bf16Path::kFmaWidened;
}

void run_bf16(const std::vector<Part<at::BFloat16, at::BFloat16>>& parts, int64_t M) {
  switch (bf16_path(M, fits_amx(parts))) {
#ifdef NEURONMM_AMX
    case Bf16Path::kAmx:
      return gemm_parts<kAmxTileRows, kAmxTileRows, AmxScope>(parts, M, amx_rows);
#endif
    case Bf16Path::kDot:
      return gemm_parts<kRowsPerItem, kRowsPerItem>(parts, M, bf16_rows);  // tiled there
    case Bf16Path::kFmaOneBlock:
      return fma_one_row_block(parts, M);
    default:
      break;
  }
  // Larger M: widen each part's x to fp32 once ([M, K] contiguous), shared by the threads (its cost is spread
  // over many more products); the tiles then broadcast it with plain loads. Parts reading the same x (the splits
  // of a factored call's first GEMM) share one copy.
  int64_t total = 0;
  for (const auto& q : parts) total += M * q.K;
  std::unique_ptr<float[]> wide(new float[total]);  // no zero fill: every element is written below
  std::vector<Part<float, at::BFloat16>> fparts;
  float* dst = wide.get();
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& q = parts[i];
    const bool same_x = i > 0 && q.x == parts[i - 1].x && q.ldx == parts[i - 1].ldx && q.K == parts[i - 1].K;
    if (!same_x) {
      float* to = dst;
      at::parallel_for(0, M, 64, [&](int64_t b, int64_t e) {
        for (int64_t m = b; m < e; ++m) widen(q.x + m * q.ldx, to + m * q.K, q.K);
      });
      dst += M * q.K;
    }
    fparts.push_back({dst - M * q.K, q.K, q.panels, q.K, q.N, q.y, q.ldy});
  }
  gemm_parts<kRowsPerItem, kRowsPerItem>(fparts, M, bf16_fma_rows);
}

void run_bf16_then(const std::vector<Part<at::BFloat16, at::BFloat16>>& first,
                   const std::vector<Part<at::BFloat16, at::BFloat16>>& second, int64_t M) {
  const auto apart = [&] {
    run_bf16(first, M);
    run_bf16(second, M);
  };
  const bool fits = fits_amx(first);
  if (fits != fits_amx(second)) return apart();  // one list may take AMX tiles and the other not
  const PanelList one(first), two(second);
  switch (bf16_path(M, fits)) {
#ifdef NEURONMM_AMX
    case Bf16Path::kAmx:
      return gemm_parts_then<kAmxTileRows, kAmxTileRows, AmxScope>(first, second, M, amx_rows);
#endif
    case Bf16Path::kDot:
      return gemm_parts_then<kRowsPerItem, kRowsPerItem>(first, second, M, bf16_rows);
    case Bf16Path::kFmaOneBlock:
      return neuronmm::balanced_for_then(fma_phase(first, one, M), fma_phase(second, two, M));
    default:
      return apart();  // x widened once per GEMM (run_bf16): the regions' cost is lost in the work
  }
}

void set_bf16_fma_rows(int64_t min_rows) {
  TORCH_CHECK(min_rows >= 0, "set_bf16_fma_rows: a row count >= 0 expected (0: never use the FMA path)");
  g_fma_min_rows.store(min_rows);
}

bool bf16_amx_available() {
#ifdef NEURONMM_AMX
  return amx_permitted();
#else
  return false;
#endif
}

void set_bf16_amx_rows(int64_t min_rows) {
  TORCH_CHECK(min_rows >= 0, "set_bf16_amx_rows: a row count >= 0 expected (0: never use AMX)");
  TORCH_CHECK(min_rows == 0 || bf16_amx_available(), "set_bf16_amx_rows: this CPU (or build) has no usable AMX");
  g_amx_min_rows.store(min_rows);
}

void check_panels_bf16(const at::Tensor& panels, int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(panels.dim() == 4 && panels.scalar_type() == at::kBFloat16 && panels.size(2) == kPanel &&
                  panels.size(1) * 2 == K && panels.size(0) * kPanel >= N && panels.is_contiguous(),
              op, ": panels [ceil(N/32), K/2, 32, 2] from pack_panels expected");
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "panel_linear: bf16 x [M, K] expected");
  check_panels_bf16(panels, x.size(1), N, "panel_linear");
  return linear_of<at::BFloat16>(x, panels, N, run_bf16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("set_bf16_fma_rows(int min_rows) -> ()", &set_bf16_fma_rows);  // no tensors: a catch-all kernel
  m.def("set_bf16_amx_rows(int min_rows) -> ()", &set_bf16_amx_rows);
  m.def("bf16_amx_available() -> bool", &bf16_amx_available);
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) {
  m.impl("pack_panels", &pack_panels);
  m.impl("panel_linear", &panel_linear);
}

#endif  // __AVX512BF16__

// ---- fp32 ------------------------------------------------------------------------------------------
// The same idea for fp32 activations (CPUs without native bf16 serve in fp32): panels of 32 output columns,
// [ceil(N/32)][K][32], so two 64-byte loads are 32 columns at one input position, multiplied by a broadcast x
// value into 32 fp32 sums (FMA). Register tile: up to 12 rows of x x one panel (24 sums); two loads of W per 24
// FMAs leave the load ports room at prefill sizes. On AVX2 (no AVX-512) the same panels go through 8-wide FMAs,
// a whole panel (3 rows) or half a panel (6 rows) a register tile.
// The panels hold fp32 weights, or bf16 ones (a model served with bf16 weights on a CPU without native bf16: half
// the bytes to stream, the arithmetic fp32's): a bf16 value widens exactly (it is the top half of an fp32), so the
// products and sums are those of the fp32 panels holding the same values, bit for bit.
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

namespace {

constexpr int64_t kPanelF = 32;     // output columns per fp32 panel (two zmm of sums)
constexpr int64_t kAheadF = 16;     // input positions prefetched ahead (16 x 128 B of fp32, 16 x 64 B of bf16)
constexpr int64_t kFarF = 64;       // input positions a single pass also prefetches into L2 (8 KB of fp32)

#if defined(__AVX512F__)
constexpr int64_t kLanesF = 16;  // fp32 values in a vector
#else
constexpr int64_t kLanesF = 8;
#endif

// Where column c (of 32) of a panel row is stored. fp32: in order. bf16: so that one vector load of 2 x kLanesF
// values widens into two vectors of columns in order by interleaving with zeros (VPUNPCKLWD / VPUNPCKHWD, which
// work within 128-bit lanes: the low one takes each lane's first four values, the high one its last four). A
// shuffle port does the widening; a shift would take an FMA port (widened by shifts, the AVX2 tiles ran 3 % slower
// than fp32 weights at 16 rows, 13 % at 32). The order is the build's: panels are packed by the build that runs them.
template <typename W>
constexpr int64_t stored_column(int64_t c) {
  if constexpr (sizeof(W) == 4) {
    return c;
  } else {
    const int64_t group = c / (2 * kLanesF), i = c % (2 * kLanesF), high = i >= kLanesF, j = i - high * kLanesF;
    return group * 2 * kLanesF + 8 * (j / 4) + 4 * high + j % 4;
  }
}

// W [N, K] (fp32 or bf16) -> panels [ceil(N/32), K, 32] in W's dtype (zero-padded columns; bf16 ones in the
// order stored_column gives).
template <typename W>
at::Tensor pack_column_panels(const at::Tensor& weight) {
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), panels = (N + kPanelF - 1) / kPanelF;
  auto out = at::zeros({panels, K, kPanelF}, w.options());
  const W* src = w.data_ptr<W>();
  W* dst = out.data_ptr<W>();
  at::parallel_for(0, panels, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t c = 0; c < kPanelF && p * kPanelF + c < N; ++c)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanelF + stored_column<W>(c)] = src[(p * kPanelF + c) * K + k];
  });
  return out;
}

at::Tensor pack_panels_f32(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "pack_panels_f32: fp32 or bf16 weight [N, K] expected");
  return weight.scalar_type() == at::kFloat ? pack_column_panels<float>(weight) : pack_column_panels<at::BFloat16>(weight);
}

// A panel's 64-byte lines (every layout's: fp32, bf16, GGUF blocks).
template <typename W>
constexpr int64_t panel_lines(int64_t K) {
  return neuronmm::panel_elems<W>(K) * int64_t(sizeof(W)) / 64;
}

// Prefetches input position k + Ahead of a panel (one line of bf16 weights, two of fp32) into L1 (_MM_HINT_T0)
// or L2 (_MM_HINT_T1).
using Hint = decltype(_MM_HINT_T0);  // GCC's enum _mm_hint, clang's int

template <int64_t Ahead = kAheadF, Hint Locality = _MM_HINT_T0, typename W>
__attribute__((always_inline)) inline void prefetch_row(const W* panel, int64_t k) {
  _mm_prefetch(reinterpret_cast<const char*>(panel + (k + Ahead) * kPanelF), Locality);
  if constexpr (sizeof(W) == 4) _mm_prefetch(reinterpret_cast<const char*>(panel + (k + Ahead) * kPanelF + 16), Locality);
}

// A tile that reads its panel in a single pass streams it from DRAM, and 16 positions ahead are not enough: with
// a few rows a position takes a few cycles, so the L1 prefetch runs less than a DRAM latency ahead, and each line in
// flight to L1 holds one of the core's few fill buffers. A second prefetch, 64 positions ahead into L2, keeps more
// lines on the way. A step's linears, with and without it alternating in one process: AVX-512 build, fp32 panels
// 1.05 x at 1 row, 1.03-1.13 x at 2-4, 1.14-1.20 x at 8-12; bf16-weight panels 1.19 x at 1 row, 1.24-1.30 x at 2-8;
// AVX2 build, fp32 1.02-1.09 x at 1-3 rows, bf16 weights 1.16-1.24 x. Several passes (Ahead) prefetch the next
// panel instead (L2Ahead; the far prefetch there measured 0.97-1.0 x).
template <bool Ahead, typename W>
__attribute__((always_inline)) inline void prefetch_single_pass(const W* panel, int64_t k) {
  if constexpr (!Ahead) prefetch_row<kFarF, _MM_HINT_T1>(panel, k);
}

// ---- GGUF blocks ----
// The fp32 GEMM over a GGUF's own quantised blocks (`--quantization gguf`): llama.cpp's Q4_1 and Q8_0 store each
// row's weights per 32 inputs as codes q with an f16 scale d (and, Q4_1, an f16 offset m), and decode them to
// w = d·q + m in fp32. d·q is exact (an f16 scale's 11 significant bits times a code's 8 at most), so one fused
// multiply-add gives that fp32 weight bit for bit, and the tiles below multiply the same values in the same order as
// the fp32 panels holding the decoded weights: the same sums, bit for bit, from ~a third of the bytes.
// Why: at decode sizes the fp32 GEMM streams 4 bytes a weight; a block panel streams 1.25 (codes as bytes, scales and
// offsets in fp32): a step's linears 3 x faster at batch 1 under the AVX2 caps. At batch 16 they are compute-bound:
// the decoding adds an FMA a vector to a panel's first tile (6 % of the arithmetic at 16 rows), and the smaller
// stream saves a little more (a step's linears 23.2 against 24.0 ms; docs/BENCHMARKS.md).
// Layout (server/models/gguf_blocks.py packs it): per panel of 32 columns, per block of 32 inputs, the 32 columns' fp32
// scales, then their fp32 offsets (-0.0 for Q8_0, so d·q keeps its sign), then the 32 inputs' 32 int8 codes each,
// columns in order: 1280 bytes a block, 40 an input. A panel's first register tile decodes the weights it reads and,
// where more tiles follow, writes them to a per-thread fp32 copy of the panel, which the others read as fp32 panels
// (from L1/L2: the decoding is paid once per weight, the stream once per panel).
constexpr int64_t kQBlock = 32;                       // inputs a block
constexpr int64_t kQScales = 2 * kPanelF * 4;         // bytes of a block's scales and offsets
constexpr int64_t kQBlockBytes = kQScales + kQBlock * kPanelF;
constexpr int64_t kQInputBytes = kQBlockBytes / kQBlock;  // 40: a block panel's bytes per input position

// A thread's fp32 copy of the panel it works on ([K][32], as fp32 panels), on a 64-byte line like the packed
// panels (from a vector's 16-byte alignment, every other 32-byte access of the tiles that read it split a line).
inline float* decoded_panel(int64_t K) {
  thread_local std::vector<float> panel;
  if (int64_t(panel.size()) < K * kPanelF + 16) panel.resize(K * kPanelF + 16);
  const auto at = reinterpret_cast<uintptr_t>(panel.data());
  return reinterpret_cast<float*>((at + 63) & ~uintptr_t(63));
}

// Where a register tile's weights come from. A tile walks K a block of kQBlock input positions at a time:
// source.at(k0) is the source from position k0, and each ISA's section below overloads prefetch(at, i), which asks
// for what is due, and load(at, i, ...), which gives the tile's columns at position k0 + i as fp32 vectors.
// Panels (fp32, or bf16 widened exactly), from the tile's first column:
template <typename W>
struct PanelWeights {
  const W* w;

  // the same panel from input position k0 on
  __attribute__((always_inline)) PanelWeights at(int64_t k0) const { return {w + k0 * kPanelF}; }
};

// One block of a block panel from column c0, input positions counted from the block's first: its codes, its
// scales (then offsets, kPanelF on), the stream position to prefetch from, and (Keep) where its decoded weights go.
// A tile's inner loop walks a block with pointer steps: the address arithmetic from k alone (k / 32, k % 32) took
// as many instructions a position as the FMAs, and held the 6-row tile to the front end's pace.
template <bool Keep>
struct BlockAt {
  const int8_t* codes;
  const float* scales;
  const int8_t* stream;
  float* decoded;

  // The stream kAheadF input positions ahead into L1, as the fp32 panels' prefetch; a single pass (neither Ahead
  // nor Keep: no next panel to fetch, no copy to write) also kFarF ahead into L2.
  template <bool Ahead>
  __attribute__((always_inline)) void prefetch(int64_t i) const {
    _mm_prefetch(reinterpret_cast<const char*>(stream + (i + kAheadF) * kQInputBytes), _MM_HINT_T0);
    if constexpr (!Ahead && !Keep)
      _mm_prefetch(reinterpret_cast<const char*>(stream + (i + kFarF) * kQInputBytes), _MM_HINT_T1);
  }
};

// Block panels, from column c0: decoded in registers; Keep also writes them to `decoded` (the panel's fp32 copy).
template <bool Keep>
struct BlockWeights {
  const int8_t* panel;
  int64_t c0;
  float* decoded;

  // the block that starts at input position k0 (a multiple of kQBlock)
  __attribute__((always_inline)) BlockAt<Keep> at(int64_t k0) const {
    const int8_t* block = panel + k0 / kQBlock * kQBlockBytes;
    return {block + kQScales + c0, reinterpret_cast<const float*>(block) + c0, panel + k0 * kQInputBytes,
            Keep ? decoded + k0 * kPanelF + c0 : nullptr};
  }
};

#if defined(__AVX512F__)
constexpr int64_t kMaxRowsF = kMaxRows;  // rows of x per register tile

// A panel row's 32 weights as fp32, columns 0-15 and 16-31: loaded, or widened from bf16 (stored_column's order).
inline void load_row(const float* w, __m512& lo, __m512& hi) {
  lo = _mm512_loadu_ps(w);
  hi = _mm512_loadu_ps(w + 16);
}
inline void load_row(const at::BFloat16* w, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_loadu_si512(w), zero = _mm512_setzero_si512();
  lo = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, v));
  hi = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, v));
}

// Columns c .. c + 15 of a block's input: w = d·q + m.
inline __m512 decode16(const int8_t* codes, const float* d, const float* m) {
  const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  return _mm512_fmadd_ps(q, _mm512_loadu_ps(d), _mm512_loadu_ps(m));
}

template <bool Ahead, typename W>
__attribute__((always_inline)) inline void prefetch(const PanelWeights<W>& src, int64_t k) {
  prefetch_row(src.w, k);
  prefetch_single_pass<Ahead>(src.w, k);
}
template <typename W>
__attribute__((always_inline)) inline void load(const PanelWeights<W>& src, int64_t k, __m512& lo, __m512& hi) {
  load_row(src.w + k * kPanelF, lo, hi);
}
template <bool Ahead, bool Keep>
__attribute__((always_inline)) inline void prefetch(const BlockAt<Keep>& src, int64_t i) {
  src.template prefetch<Ahead>(i);
}
template <bool Keep>
__attribute__((always_inline)) inline void load(const BlockAt<Keep>& src, int64_t i, __m512& lo, __m512& hi) {
  const int8_t* codes = src.codes + i * kPanelF;
  lo = decode16(codes, src.scales, src.scales + kPanelF);
  hi = decode16(codes + 16, src.scales + 16, src.scales + kPanelF + 16);
  if constexpr (Keep) {
    _mm512_storeu_ps(src.decoded + i * kPanelF, lo);
    _mm512_storeu_ps(src.decoded + i * kPanelF + 16, hi);
  }
}

template <int MT, bool Ahead, typename Src>
inline void tile_f32(const float* x, int64_t ldx, const Src& src, float* y, int64_t ldy, int64_t valid, int64_t K,
                     const PassShare& next) {
  __m512 lo[MT], hi[MT];
  for (int j = 0; j < MT; ++j) lo[j] = hi[j] = _mm512_setzero_ps();
  L2Ahead<Ahead> ahead(next);
  for (int64_t k0 = 0; k0 < K; k0 += kQBlock) {
    const auto block = src.at(k0);
    const float* xk = x + k0;
    for (int64_t i = 0, n = std::min(kQBlock, K - k0); i < n; ++i) {
      prefetch<Ahead>(block, i);
      ahead.step(k0 + i);
      __m512 w0, w1;
      load(block, i, w0, w1);
      for (int j = 0; j < MT; ++j) {
        const __m512 xv = _mm512_set1_ps(xk[j * ldx + i]);
        lo[j] = _mm512_fmadd_ps(xv, w0, lo[j]);
        hi[j] = _mm512_fmadd_ps(xv, w1, hi[j]);
      }
    }
  }
  for (int j = 0; j < MT; ++j) store_row(y + j * ldy, lo[j], hi[j], valid);
}

#else
constexpr int64_t kMaxRowsF = 6;  // rows of a half-panel tile: 12 ymm of sums, two weight vectors, a broadcast
constexpr int64_t kWholePanelRows = 3;  // up to this many rows, one pass over the whole panel (3 x 4 ymm of sums)

// 16 weights of a panel row as fp32, in two vectors of 8 columns: loaded, or widened from bf16 (stored_column's
// order).
inline void load16(const float* w, __m256& lo, __m256& hi) {
  lo = _mm256_loadu_ps(w);
  hi = _mm256_loadu_ps(w + 8);
}
inline void load16(const at::BFloat16* w, __m256& lo, __m256& hi) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), zero = _mm256_setzero_si256();
  lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, v));
  hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, v));
}

// Columns c .. c + 7 of a block's input: w = d·q + m.
inline __m256 decode8(const int8_t* codes, const float* d, const float* m) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes))));
  return _mm256_fmadd_ps(q, _mm256_loadu_ps(d), _mm256_loadu_ps(m));
}

template <int NV, bool Ahead, typename W>
__attribute__((always_inline)) inline void prefetch(const PanelWeights<W>& src, int64_t k) {
  prefetch_single_pass<Ahead>(src.w, k);
  if constexpr (NV == 4)
    prefetch_row(src.w, k);
  else  // half a panel: its 16 columns are one line of fp32 weights, half of one of bf16
    _mm_prefetch(reinterpret_cast<const char*>(src.w + (k + kAheadF) * kPanelF), _MM_HINT_T0);
}
template <int NV, typename W>
__attribute__((always_inline)) inline void load(const PanelWeights<W>& src, int64_t k, __m256 (&wv)[NV]) {
#pragma GCC unroll 2
  for (int c = 0; c < NV / 2; ++c) load16(src.w + k * kPanelF + 16 * c, wv[2 * c], wv[2 * c + 1]);
}
template <int NV, bool Ahead, bool Keep>
__attribute__((always_inline)) inline void prefetch(const BlockAt<Keep>& src, int64_t i) {
  src.template prefetch<Ahead>(i);
}
template <int NV, bool Keep>
__attribute__((always_inline)) inline void load(const BlockAt<Keep>& src, int64_t i, __m256 (&wv)[NV]) {
  const int8_t* codes = src.codes + i * kPanelF;
#pragma GCC unroll 4
  for (int c = 0; c < NV; ++c) wv[c] = decode8(codes + 8 * c, src.scales + 8 * c, src.scales + kPanelF + 8 * c);
  if constexpr (Keep) {
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) _mm256_storeu_ps(src.decoded + i * kPanelF + 8 * c, wv[c]);
  }
}

// The AVX2 tile: MT rows x NV * 8 columns of a panel (src: its first column; rows of the panel are kPanelF apart).
// Each sum is the same chain of FMAs over k as in the AVX-512 tile, so the same bits.
//   NV = 4, MT <= 3: the whole panel in one pass, for the memory-bound few-row calls (a panel read once).
//   NV = 2, MT <= 6: half a panel, for more rows: two loads of W per 12 FMAs instead of four per 12, and a half
//   panel (K x 64 B: 36 KB at K = 576) stays in L1 across a call's row tiles.
// The epilogue's loops are unrolled on purpose: with a loop index into acc left in them, GCC keeps acc in memory
// too and stores every sum to the stack on every k, which halved the FMA rate.
template <int MT, int NV, bool Ahead, typename Src>
inline void tile_f32(const float* x, int64_t ldx, const Src& src, float* y, int64_t ldy, int64_t valid, int64_t K,
                     const PassShare& next) {
  __m256 acc[MT][NV];
#pragma GCC unroll 8
  for (int j = 0; j < MT; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) acc[j][c] = _mm256_setzero_ps();
  L2Ahead<Ahead> ahead(next);
  for (int64_t k0 = 0; k0 < K; k0 += kQBlock) {
    const auto block = src.at(k0);
    const float* xk = x + k0;
    for (int64_t i = 0, n = std::min(kQBlock, K - k0); i < n; ++i) {
      prefetch<NV, Ahead>(block, i);
      ahead.step(k0 + i);
      __m256 wv[NV];
      load<NV>(block, i, wv);
#pragma GCC unroll 8
      for (int j = 0; j < MT; ++j) {
        const __m256 xv = _mm256_broadcast_ss(xk + j * ldx + i);
#pragma GCC unroll 4
        for (int c = 0; c < NV; ++c) acc[j][c] = _mm256_fmadd_ps(xv, wv[c], acc[j][c]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < MT; ++j)
#pragma GCC unroll 4
    for (int c = 0; c < NV; ++c) store8(y + j * ldy + 8 * c, acc[j][c], valid - 8 * c);
}

template <int MT, int NV, bool Ahead, typename Src>
void rows_of_f32(const float* x, int64_t ldx, const Src& src, float* y, int64_t ldy, int64_t valid, int64_t K,
                 int64_t rows, const PassShare& next) {
  if constexpr (MT > 0) {
    if (rows == MT) return tile_f32<MT, NV, Ahead>(x, ldx, src, y, ldy, valid, K, next);
    rows_of_f32<MT - 1, NV, Ahead>(x, ldx, src, y, ldy, valid, K, rows, next);
  }
}

// A row block against one panel: a few rows in one pass over the panel (memory-bound: the stream is the work);
// more, each half panel in turn against every row tile of the block. Block panels: each half panel's first row tile
// decodes it (and keeps it if more tiles follow), the others read the decoded half as fp32 panels.
template <typename W>
void f32_rows(const float* x, int64_t ldx, const W* panel, float* y, int64_t ldy, int64_t valid, int64_t K,
              int64_t rows) {
  constexpr bool blocks = std::is_same_v<W, int8_t>;
  if (rows <= kWholePanelRows) {
    if constexpr (blocks)
      return rows_of_f32<kWholePanelRows, 4, false>(x, ldx, BlockWeights<false>{panel, 0, nullptr}, y, ldy, valid, K,
                                                    rows, PassShare{});
    else
      return rows_of_f32<kWholePanelRows, 4, false>(x, ldx, PanelWeights<W>{panel}, y, ldy, valid, K, rows,
                                                    PassShare{});
  }
  const int64_t halves = valid > 16 ? 2 : 1, tiles = (rows + kMaxRowsF - 1) / kMaxRowsF;
  const NextPanel next(valid > kPanelF ? panel + neuronmm::panel_elems<W>(K) : nullptr, panel_lines<W>(K),
                       halves * tiles, K);
  float* const decoded = blocks ? decoded_panel(K) : nullptr;
  for (int64_t h = 0, i = 0; h < halves; ++h)
    for (int64_t m = 0; m < rows; m += kMaxRowsF, ++i) {
      const auto run = [&](const auto& src) {
        rows_of_f32<kMaxRowsF, 2, true>(x + m * ldx, ldx, src, y + m * ldy + 16 * h, ldy, valid - 16 * h, K,
                                        std::min(kMaxRowsF, rows - m), next.pass(i));
      };
      if constexpr (!blocks)
        run(PanelWeights<W>{panel + 16 * h});
      else if (m > 0)  // a block panel's later tiles read its decoded copy
        run(PanelWeights<float>{decoded + 16 * h});
      else if (tiles > 1)
        run(BlockWeights<true>{panel, 16 * h, decoded});
      else
        run(BlockWeights<false>{panel, 16 * h, nullptr});
    }
}
#endif

#if defined(__AVX512F__)
template <int MT, bool Ahead, typename Src>
void rows_of_f32(const float* x, int64_t ldx, const Src& src, float* y, int64_t ldy, int64_t valid, int64_t K,
                 int64_t rows, const PassShare& next) {
  if constexpr (MT > 0) {
    if (rows == MT) return tile_f32<MT, Ahead>(x, ldx, src, y, ldy, valid, K, next);
    rows_of_f32<MT - 1, Ahead>(x, ldx, src, y, ldy, valid, K, rows, next);
  }
}

// A row block against one panel, a register tile of up to kMaxRowsF rows at a time. Block panels: the first tile
// decodes (and keeps the panel if more tiles follow), the others read the decoded copy as fp32 panels.
template <typename W>
void f32_rows(const float* x, int64_t ldx, const W* panel, float* y, int64_t ldy, int64_t valid, int64_t K,
              int64_t rows) {
  constexpr bool blocks = std::is_same_v<W, int8_t>;
  const NextPanel next(valid > kPanelF ? panel + neuronmm::panel_elems<W>(K) : nullptr, panel_lines<W>(K),
                       (rows + kMaxRowsF - 1) / kMaxRowsF, K);
  float* const decoded = blocks && rows > kMaxRowsF ? decoded_panel(K) : nullptr;
  tile_row_block<kMaxRowsF, true>(rows, next, [&](int64_t m, int64_t n, const PassShare& share, auto ahead) {
    const auto run = [&](const auto& src) {
      rows_of_f32<kMaxRowsF, decltype(ahead)::value>(x + m * ldx, ldx, src, y + m * ldy, ldy, valid, K, n, share);
    };
    if constexpr (!blocks)
      run(PanelWeights<W>{panel});
    else if (m > 0)
      run(PanelWeights<float>{decoded});
    else if (decoded)
      run(BlockWeights<true>{panel, 0, decoded});
    else
      run(BlockWeights<false>{panel, 0, nullptr});
  });
}
#endif

// The AVX-512 and the AVX2 tile alike at every row count: at 512 rows the AVX2 tile runs at 89 % of the FMA peak,
// above torch's (MKL's) AVX2 sgemm on the same panels, which an earlier AVX2 build used from a few rows on.
// (W: fp32, bf16 or GGUF block panels.)
template <typename W>
void run_f32(const std::vector<Part<float, W, float>>& parts, int64_t M) {
  gemm_parts<kRowsPerItem, kRowsPerItem>(parts, M, f32_rows<W>);  // f32_rows tiles a row block itself
}

template <typename W>
void run_f32_then(const std::vector<Part<float, W, float>>& first, const std::vector<Part<float, W, float>>& second,
                  int64_t M) {
  gemm_parts_then<kRowsPerItem, kRowsPerItem>(first, second, M, f32_rows<W>);
}

// GGUF block panels [ceil(N/32), K/32, 1280] int8 (server/models/gguf_blocks.py).
void check_block_panels(const at::Tensor& panels, int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kChar && K % kQBlock == 0 &&
                  panels.size(1) * kQBlock == K && panels.size(2) == kQBlockBytes && panels.size(0) * kPanelF >= N &&
                  panels.is_contiguous(),
              op, ": GGUF block panels [ceil(N/32), K/32, 1280] int8 expected (K a multiple of 32)");
}

template <typename W>
void check_panels_f32(const at::Tensor& panels, int64_t K, int64_t N, const char* op) {
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == c10::CppTypeToScalarType<W>::value &&
                  panels.size(2) == kPanelF && panels.size(1) == K && panels.size(0) * kPanelF >= N &&
                  panels.is_contiguous(),
              op, ": panels [ceil(N/32), K, 32] from pack_panels_f32 expected");
}

at::Tensor panel_linear_f32(const at::Tensor& x, const at::Tensor& panels, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "panel_linear_f32: fp32 x [M, K] expected");
  if (panels.scalar_type() == at::kChar) {
    check_block_panels(panels, x.size(1), N, "panel_linear_f32");
    return linear_of<float, int8_t>(x, panels, N, run_f32<int8_t>);
  }
  if (panels.scalar_type() == at::kBFloat16) {
    check_panels_f32<at::BFloat16>(panels, x.size(1), N, "panel_linear_f32");
    return linear_of<float, at::BFloat16>(x, panels, N, run_f32<at::BFloat16>);
  }
  check_panels_f32<float>(panels, x.size(1), N, "panel_linear_f32");
  return linear_of<float>(x, panels, N, run_f32<float>);
}

// (Tensor?[] as the dispatcher's own type for it, so csrc/decoder.cpp can call this op unboxed.)
at::Tensor factored_linear(const at::Tensor& x, const at::Tensor& first, at::IntArrayRef splits,
                           const c10::List<std::optional<at::Tensor>>& seconds, at::IntArrayRef outs) {
  TORCH_CHECK(x.dim() == 2, "factored_linear: x [M, K] expected");
  int64_t out_width = 0;
  for (int64_t n : outs) out_width += n;
  auto y = at::empty({x.size(0), out_width}, x.options());
  neuronmm::factored_linear_into(x, first, splits, seconds, outs, y, at::Tensor());
  return y;
}

}  // namespace

void neuronmm::factored_linear_into(const at::Tensor& x, const at::Tensor& first, at::IntArrayRef splits,
                                    const c10::List<std::optional<at::Tensor>>& seconds, at::IntArrayRef outs,
                                    at::Tensor& y, const at::Tensor& scratch) {
  TORCH_CHECK(x.dim() == 2, "factored_linear: x [M, K] expected");
  if (first.scalar_type() == at::kByte) return factored_linear_int8(x, first, splits, seconds, outs, y, scratch);
  if (x.scalar_type() == at::kFloat && first.scalar_type() == at::kChar)  // GGUF block panels, fp32 activations
    return factored_impl<float, int8_t>(x, first, splits, seconds, outs, y, scratch, run_f32<int8_t>,
                                        run_f32_then<int8_t>, check_block_panels);
  if (x.scalar_type() == at::kFloat && first.scalar_type() == at::kBFloat16)  // bf16 weights, fp32 activations
    return factored_impl<float, at::BFloat16>(x, first, splits, seconds, outs, y, scratch, run_f32<at::BFloat16>,
                                              run_f32_then<at::BFloat16>, check_panels_f32<at::BFloat16>);
  if (x.scalar_type() == at::kFloat)
    return factored_impl<float>(x, first, splits, seconds, outs, y, scratch, run_f32<float>, run_f32_then<float>,
                                check_panels_f32<float>);
#if defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    for (int64_t s : splits) TORCH_CHECK(s % 2 == 0, "factored_linear: bf16 panels pair K, so every split must be even");
    return factored_impl<at::BFloat16>(x, first, splits, seconds, outs, y, scratch, run_bf16, run_bf16_then,
                                       check_panels_bf16);
  }
#endif
  TORCH_CHECK(false, "factored_linear: fp32 x (or bf16 on a CPU with AVX512-BF16) expected");
}

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.def("pack_panels_f32(Tensor weight) -> Tensor");
  m.def("panel_linear_f32(Tensor x, Tensor panels, int out_features) -> Tensor");
  m.def("factored_linear(Tensor x, Tensor first, int[] splits, Tensor?[] seconds, int[] out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) {
  m.impl("pack_panels_f32", &pack_panels_f32);
  m.impl("panel_linear_f32", &panel_linear_f32);
  m.impl("factored_linear", &factored_linear);
}

#else
void neuronmm::factored_linear_into(const at::Tensor&, const at::Tensor&, at::IntArrayRef,
                                    const c10::List<std::optional<at::Tensor>>&, at::IntArrayRef, at::Tensor&,
                                    const at::Tensor&) {
  TORCH_CHECK(false, "factored_linear: this build has neither AVX-512 nor AVX2 with FMA");
}
#endif  // __AVX512F__ || (__AVX2__ && __FMA__)
