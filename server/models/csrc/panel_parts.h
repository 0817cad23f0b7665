// What every panel GEMM kernel shares (csrc/small_gemm.cpp's bf16 and fp32 ones, csrc/int8_gemm.cpp's): a call's GEMMs
// as parts over one list of panels, and the factored linear (X·U·V, or projections sharing their first GEMM) on top
// of a kernel's runners.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

namespace neuronmm {

// Elements of one panel of K inputs: 32 columns of K weights each; int8 panels (uint8_t) hold the 32 columns' fp32
// scales after them (128 bytes); GGUF block panels (int8_t, csrc/small_gemm.cpp) hold per block of 32 inputs the
// columns' fp32 scales and offsets (256 bytes) and 32 x 32 codes: 40 bytes an input.
template <typename W>
constexpr int64_t panel_elems(int64_t K) {
  if constexpr (std::is_same_v<W, uint8_t>) return K * 32 + 128;
  if constexpr (std::is_same_v<W, int8_t>) return K * 40;
  return K * 32;
}

// One GEMM of a call: y[M, :N] (row stride ldy) = x[M, :K] (row stride ldx) · Wᵀ, W as panels of 32 columns
// (panel_elems = K * 32 elements each, in either dtype's layout). Strides let a part read a column range of
// another GEMM's output and write a column range of a shared output, with no copies. X, T, Y: the element
// types of x, of the panels and of y.
template <typename X, typename T, typename Y = T>
struct Part {
  const X* x;
  int64_t ldx;
  const T* panels;
  int64_t K, N;
  Y* y;
  int64_t ldy;
};

// All parts' panels as one work list: panel p is panel p - first[i] of part i, and costs K_i (a row of x
// against a panel is K multiply-adds).
struct PanelList {
  std::vector<int64_t> first;     // first panel of each part, and the total last
  std::vector<int64_t> k_before;  // summed cost of the panels before each part, and the total last
  std::vector<int64_t> k;         // each part's K: the cost of one of its panels

  template <typename X, typename T, typename Y>
  explicit PanelList(const std::vector<Part<X, T, Y>>& parts)
      : first(parts.size() + 1, 0), k_before(parts.size() + 1, 0), k(parts.size()) {
    for (size_t i = 0; i < parts.size(); ++i) {
      k[i] = parts[i].K;
      first[i + 1] = first[i] + (parts[i].N + 31) / 32;
      k_before[i + 1] = k_before[i] + (first[i + 1] - first[i]) * k[i];
    }
  }
  int64_t panels() const { return first.back(); }
  size_t part_of(int64_t p) const { return std::upper_bound(first.begin(), first.end(), p) - first.begin() - 1; }
  int64_t cost_of(int64_t p) const { return k[part_of(p)]; }
  // the summed cost of panels 0 .. p-1
  int64_t cost_before(int64_t p) const {
    if (p >= panels()) return k_before.back();
    const size_t i = part_of(p);
    return k_before[i] + (p - first[i]) * k[i];
  }
};

// Runs a list of parts with one kernel: x and y in T, panels in W (T too, but for bf16 weights under fp32).
template <typename T, typename W = T>
using Runner = void (*)(const std::vector<Part<T, W, T>>& parts, int64_t M);

// Runs `first`, then `second` (which reads first's output), with one kernel, in one parallel region where it can.
template <typename T, typename W = T>
using RunnerThen = void (*)(const std::vector<Part<T, W, T>>& first, const std::vector<Part<T, W, T>>& second, int64_t M);

// ---- factored linear -------------------------------------------------------------------------------
// y = [t_0 B_0ᵀ | t_1 B_1ᵀ | ...] with t = x Fᵀ = [t_0 | t_1 | ...] split by `splits`: a low-rank linear
// (one part: F = A, then B) or gate and up sharing their first GEMM (two parts, a dense part passing its
// slice of t through, B absent). The CPU form of X·U·V: t stays in cache between the two GEMMs, and a
// layer's low-rank projections are one call instead of a GEMM per factor plus a split and a concatenation; both
// GEMMs run in one parallel region (a barrier between them) unless a slice of t must be copied out between.
template <typename T, typename W = T>
void factored_impl(const at::Tensor& x, const at::Tensor& first, at::IntArrayRef splits,
                   const c10::List<std::optional<at::Tensor>>& seconds, at::IntArrayRef outs, at::Tensor& y,
                   const at::Tensor& scratch, Runner<T, W> run, RunnerThen<T, W> run_then,
                   void (*check)(const at::Tensor&, int64_t, int64_t, const char*)) {
  TORCH_CHECK(splits.size() == seconds.size() && splits.size() == outs.size() && !splits.empty(),
              "factored_linear: splits, seconds and out_features must have one entry per part");
  const int64_t M = x.size(0), K = x.size(1);
  int64_t width = 0, out_width = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    const std::optional<at::Tensor> second = seconds.get(i);
    TORCH_CHECK(second.has_value() || outs[i] == splits[i], "factored_linear: a part without B passes its slice through");
    if (second.has_value()) check(*second, splits[i], outs[i], "factored_linear (second)");
    width += splits[i];
    out_width += outs[i];
  }
  check(first, K, width, "factored_linear (first)");
  const auto xc = x.contiguous();
  // The first GEMM as one part per split when every split starts on a panel (32 columns): a part without B
  // then writes its slice of y itself. Otherwise one part writes all of t, and those slices are copied after.
  bool aligned = true, any_second = false;
  for (size_t i = 0, col = 0; i < splits.size(); ++i) {
    any_second = any_second || seconds.get(i).has_value();
    col += splits[i];
    aligned = aligned && (i + 1 == splits.size() || col % 32 == 0);
  }
  TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == M && y.size(1) == out_width &&
                  y.scalar_type() == x.scalar_type(),
              "factored_linear: y must be contiguous [M, sum(out_features)] in x's dtype");
  // t only where something reads it (a dense projection, one part passing through, needs none)
  const bool needs_t = !aligned || any_second;
  TORCH_CHECK(!needs_t || !scratch.defined() ||
                  (scratch.is_contiguous() && scratch.scalar_type() == x.scalar_type() && scratch.numel() >= M * width),
              "factored_linear: scratch must be contiguous, in x's dtype, of at least M x sum(splits) elements");
  const auto t = needs_t && !scratch.defined() ? at::empty({M, width}, x.options()) : scratch;
  T* const tp = needs_t ? t.data_ptr<T>() : nullptr;
  T* const yp = y.data_ptr<T>();
  std::vector<Part<T, W, T>> firsts, parts;
  std::vector<std::array<int64_t, 3>> copies;  // (column of t, column of y, width) of each slice to copy
  if (!aligned) firsts.push_back({xc.data_ptr<T>(), K, first.data_ptr<W>(), K, width, tp, width});
  int64_t col = 0, out_col = 0;
  for (size_t i = 0; i < splits.size(); ++i) {
    const std::optional<at::Tensor> second = seconds.get(i);
    const bool through = !second.has_value();
    if (aligned)
      firsts.push_back({xc.data_ptr<T>(), K, first.data_ptr<W>() + col / 32 * panel_elems<W>(K), K, splits[i],
                        through ? yp + out_col : tp + col, through ? out_width : width});
    else if (through)
      copies.push_back({col, out_col, splits[i]});
    if (!through) parts.push_back({tp + col, width, second->data_ptr<W>(), splits[i], outs[i], yp + out_col, out_width});
    col += splits[i];
    out_col += outs[i];
  }
  if (copies.empty() && !parts.empty()) return run_then(firsts, parts, M);
  run(firsts, M);
  for (const auto& [from, to, n] : copies)
    for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * out_width + to, tp + m * width + from, n * sizeof(T));
  if (!parts.empty()) run(parts, M);
}

// factored_linear_into for int8 panels (csrc/int8_gemm.cpp; fails where the build has no AVX512-VNNI).
void factored_linear_int8(const at::Tensor& x, const at::Tensor& first, at::IntArrayRef splits,
                          const c10::List<std::optional<at::Tensor>>& seconds, at::IntArrayRef outs, at::Tensor& y,
                          const at::Tensor& scratch);

}  // namespace neuronmm
