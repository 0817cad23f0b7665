// Prefill tiles (prefill_attention.h). A tile's query rows (its tokens x a group's query heads, up to 16) sit in
// the lanes of two 8-lane vectors: the queries transposed, qt[d][row]. Then every key j of the context gives its
// scores for all rows at once, s[j][row] = sum_d k[j][d] qt[d][row] (a key value broadcast against the rows), the
// softmax runs down the keys with the rows in the lanes (a causal mask where a row's token has not reached key j
// yet), and out[row][d] = sum_j p[j][row] v[j][d] (a probability broadcast against a value row). Both products are
// register tiles of up to 12 sums (6 keys or rows x 2 vectors), at ~90 % of the FMA peak; the exp is most of the
// rest. An item is two tiles of a run against one KV head, so each cached block is widened to fp32 once for both.
#include "prefill_attention.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "vec8.h"
#include "work_split.h"

namespace neuronmm {

namespace {

constexpr int64_t kLanes = 16;  // query rows a tile holds: two 8-lane vectors

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
constexpr bool kTiles = true;
using vec8::fast_exp8;
using vec8::load8;

// A tile's scratch, per thread and kept across calls (a prefill step makes one call a layer).
struct TileScratch {
  std::vector<float> qt;      // [tile][head_dim][16]: the rows' queries, times the softmax scale
  std::vector<float> scores;  // [tile][context][16]: scores, then probabilities
  std::vector<float> block;   // [block_size][head_dim]: a cached block widened to fp32
  std::vector<float> acc;     // [tile][16][head_dim]: the rows' value sums
};

// A cached block's `len` rows of keys or values as fp32: an fp32 cache as it is, another widened into `dst`.
template <typename C>
const float* widened(const C* rows, int64_t len, int64_t head_dim, float* dst) {
  if constexpr (std::is_same_v<C, float>) {
    return rows;
  } else {
    for (int64_t i = 0; i < len * head_dim; i += 8) _mm256_storeu_ps(dst + i, load8(rows + i));
    return dst;
  }
}

// The register tile both products share: for each of `steps` steps t, two vectors (w + t * w_step) times N
// broadcast values (b + i * b_row + t * b_step), added into the N x 2 sums lo / hi. The scores take a key value
// against the queries' lanes; the value sums a probability against a value row.
// (Every loop over the sums unrolled: with a loop index into them left anywhere, GCC keeps them on the stack and
// stores each one every step, as small_gemm.cpp's tiles found.)
template <int N>
__attribute__((always_inline)) inline void broadcast_tile(const float* w, int64_t w_step, const float* b,
                                                          int64_t b_row, int64_t b_step, int64_t steps, __m256 (&lo)[N],
                                                          __m256 (&hi)[N]) {
  for (int64_t t = 0; t < steps; ++t) {
    const __m256 w0 = _mm256_loadu_ps(w + t * w_step), w1 = _mm256_loadu_ps(w + t * w_step + 8);
#pragma GCC unroll 6
    for (int i = 0; i < N; ++i) {
      const __m256 bi = _mm256_broadcast_ss(b + i * b_row + t * b_step);
      lo[i] = _mm256_fmadd_ps(bi, w0, lo[i]);
      hi[i] = _mm256_fmadd_ps(bi, w1, hi[i]);
    }
  }
}

// Scores of KK keys (rows of k, head_dim apart) for all 16 query rows: s[j][0..15] (s: 16 floats a key), their
// largest a row taken into `max` (lanes: rows).
template <int KK>
void score_keys(const float* qt, const float* k, int64_t head_dim, float* s, __m256 (&max)[2]) {
  __m256 lo[KK], hi[KK];
#pragma GCC unroll 6
  for (int j = 0; j < KK; ++j) lo[j] = hi[j] = _mm256_setzero_ps();
  broadcast_tile<KK>(qt, kLanes, k, head_dim, 1, head_dim, lo, hi);
#pragma GCC unroll 6
  for (int j = 0; j < KK; ++j) {
    _mm256_storeu_ps(s + j * kLanes, lo[j]);
    _mm256_storeu_ps(s + j * kLanes + 8, hi[j]);
    max[0] = _mm256_max_ps(max[0], lo[j]);
    max[1] = _mm256_max_ps(max[1], hi[j]);
  }
}

// acc[r][0..15] += sum_j p[j][r] v[j][0..15] for RR rows (acc rows head_dim apart, p 16 floats a key).
template <int RR>
void add_values(const float* p, const float* v, int64_t len, int64_t head_dim, float* acc) {
  __m256 lo[RR], hi[RR];
#pragma GCC unroll 6
  for (int r = 0; r < RR; ++r) {
    lo[r] = _mm256_loadu_ps(acc + r * head_dim);
    hi[r] = _mm256_loadu_ps(acc + r * head_dim + 8);
  }
  broadcast_tile<RR>(v, head_dim, p, 1, kLanes, len, lo, hi);
#pragma GCC unroll 6
  for (int r = 0; r < RR; ++r) {
    _mm256_storeu_ps(acc + r * head_dim, lo[r]);
    _mm256_storeu_ps(acc + r * head_dim + 8, hi[r]);
  }
}

// The register tiles at any count up to 6 (keys or rows).
template <int N, typename Fn>
void up_to_six(int64_t n, const Fn& fn) {
  if constexpr (N > 0) {
    if (n == N) return fn(std::integral_constant<int, N>{});
    up_to_six<N - 1>(n, fn);
  }
}

// fn(begin, count) over [0, n) in register tiles of up to 6, as even as they go (15 rows: 5 + 5 + 5, not 6 + 6 + 3:
// a tile of 3 does half the FMAs of a tile of 6 for the same loads).
template <typename Fn>
void even_sixes(int64_t n, const Fn& fn) {
  const int64_t tiles = (n + 5) / 6;
  for (int64_t t = 0, begin = 0; t < tiles; ++t) {
    const int64_t count = (n - begin) / (tiles - t);
    up_to_six<6>(count, [&](auto c) { fn(begin, c); });
    begin += count;
  }
}

// A run's consecutive tiles (up to kTilesAnItem) against one KV head, each cached block widened once for all of them.
constexpr int64_t kTilesAnItem = 2;

// A tile's scores of keys [n0, n) (past its first token's context: s[j][0..15] from `scores`), masked to -inf where
// a row's token has not reached key j (row r's sees keys [0, n0 + r / group), padding lanes all), their largest a
// row taken into `max`.
inline void mask_and_max(float* scores, int64_t n, int64_t n0, int64_t rows, int64_t group, __m256 (&max)[2]) {
  alignas(32) int32_t seen[kLanes];
  for (int64_t r = 0; r < kLanes; ++r) seen[r] = static_cast<int32_t>(r < rows ? n0 + r / group : n);
  const __m256i seen_lo = _mm256_load_si256(reinterpret_cast<const __m256i*>(seen)),
                seen_hi = _mm256_load_si256(reinterpret_cast<const __m256i*>(seen + 8));
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t j = n0; j < n; ++j) {
    float* sj = scores + (j - n0) * kLanes;
    const __m256i at = _mm256_set1_epi32(static_cast<int32_t>(j));
    const __m256 lo = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sj), _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen_lo, at)));
    const __m256 hi = _mm256_blendv_ps(ninf, _mm256_loadu_ps(sj + 8),
                                       _mm256_castsi256_ps(_mm256_cmpgt_epi32(seen_hi, at)));
    _mm256_storeu_ps(sj, lo);
    _mm256_storeu_ps(sj + 8, hi);
    max[0] = _mm256_max_ps(max[0], lo);
    max[1] = _mm256_max_ps(max[1], hi);
  }
}

// Keys [0, len) of a tile's scores to probabilities in place, exp(score - max) (a masked score's 0 exactly, as
// exp_block's), their sums added to `sum`. Run a block at a time just before the block's values take them, so the
// probabilities are read from L1.
inline void exp_keys(float* scores, int64_t len, const __m256 (&max)[2], __m256 (&sum)[2]) {
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  for (int64_t j = 0; j < len; ++j)
    for (int h = 0; h < 2; ++h) {
      float* sj = scores + j * kLanes + 8 * h;
      const __m256 x = _mm256_loadu_ps(sj);
      const __m256 e = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), fast_exp8(_mm256_sub_ps(x, max[h])));
      _mm256_storeu_ps(sj, e);
      sum[h] = _mm256_add_ps(sum[h], e);
    }
}

// `count` consecutive tiles of one sequence (tokens [tiles[0].first, ..) at consecutive positions) against one KV
// head; tile i's tokens see the contexts n_i0, n_i0 + 1, .. (context_lens).
template <typename C>
void attend_tiles(const PrefillTile* tiles, int64_t count, int64_t kv, const float* q_rot, const C* k_cache,
                  const C* v_cache, const int32_t* table, const int32_t* context_lens, int64_t num_heads,
                  int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, float* out,
                  TileScratch& s) {
  const int64_t group = num_heads / num_kv_heads;
  const auto rows_of = [&](int64_t i) { return tiles[i].tokens * group; };
  const auto first_context = [&](int64_t i) { return static_cast<int64_t>(context_lens[tiles[i].first]); };
  const auto last_context = [&](int64_t i) { return first_context(i) + tiles[i].tokens - 1; };
  const int64_t n = last_context(count - 1), q_size = head_dim * kLanes, acc_size = kLanes * head_dim;
  const auto row_of = [&](int64_t i, int64_t r) {  // offset of tile i's row r's query (and output) head
    return ((tiles[i].first + r / group) * num_heads + kv * group + r % group) * head_dim;
  };
  s.qt.assign(count * q_size, 0.f);  // lanes past a tile's rows stay 0: their scores are 0, their outputs unused
  for (int64_t i = 0; i < count; ++i)
    for (int64_t r = 0; r < rows_of(i); ++r) {
      const float* q = q_rot + row_of(i, r);
      for (int64_t d = 0; d < head_dim; ++d) s.qt[i * q_size + d * kLanes + r] = q[d] * scale;
    }
  s.scores.resize(count * n * kLanes);  // tile i's [its context][16] from i * n * 16
  // each tile's largest score and its sum of probabilities a row (lanes: rows); the keys past a tile's first token
  // take theirs after the mask, so score_keys puts theirs aside
  __m256 max[kTilesAnItem][2], sum[kTilesAnItem][2], unused[2] = {};
  for (int64_t i = 0; i < count; ++i) {
    max[i][0] = max[i][1] = _mm256_set1_ps(-INFINITY);
    sum[i][0] = sum[i][1] = _mm256_setzero_ps();
  }
  s.block.resize(block_size * head_dim);
  const auto block_rows = [&](const C* cache, int64_t start) {
    return cache + (static_cast<int64_t>(table[start / block_size]) * num_kv_heads + kv) * block_size * head_dim;
  };
  for (int64_t start = 0; start < n; start += block_size) {
    const float* keys = widened(block_rows(k_cache, start), std::min(block_size, n - start), head_dim,
                                s.block.data());
    for (int64_t i = 0; i < count; ++i) {
      // keys every row sees (their scores' largest taken as they are stored), then the ones the mask may hide
      const int64_t seen = std::min(block_size, std::max<int64_t>(0, first_context(i) - start)),
                    len = std::min(block_size, std::max<int64_t>(0, last_context(i) - start));
      float* scores = s.scores.data() + (i * n + start) * kLanes;
      even_sixes(seen, [&](int64_t j, auto kk) {
        score_keys<decltype(kk)::value>(s.qt.data() + i * q_size, keys + j * head_dim, head_dim,
                                        scores + j * kLanes, max[i]);
      });
      even_sixes(len - seen, [&](int64_t j, auto kk) {
        score_keys<decltype(kk)::value>(s.qt.data() + i * q_size, keys + (seen + j) * head_dim, head_dim,
                                        scores + (seen + j) * kLanes, unused);
      });
    }
  }
  for (int64_t i = 0; i < count; ++i)
    mask_and_max(s.scores.data() + (i * n + first_context(i)) * kLanes, last_context(i), first_context(i),
                 rows_of(i), group, max[i]);
  s.acc.assign(count * acc_size, 0.f);
  for (int64_t start = 0; start < n; start += block_size) {
    const float* values = widened(block_rows(v_cache, start), std::min(block_size, n - start), head_dim,
                                  s.block.data());
    for (int64_t i = 0; i < count; ++i) {
      const int64_t len = std::min(block_size, last_context(i) - start);
      if (len <= 0) continue;
      float* probs = s.scores.data() + (i * n + start) * kLanes;
      exp_keys(probs, len, max[i], sum[i]);
      even_sixes(rows_of(i), [&](int64_t r0, auto rr) {
        for (int64_t d0 = 0; d0 < head_dim; d0 += 16)
          add_values<decltype(rr)::value>(probs + r0, values + d0, len, head_dim,
                                          s.acc.data() + i * acc_size + r0 * head_dim + d0);
      });
    }
  }
  alignas(32) float sums[kTilesAnItem][kLanes];
  for (int64_t i = 0; i < count; ++i) {
    _mm256_store_ps(sums[i], sum[i][0]);
    _mm256_store_ps(sums[i] + 8, sum[i][1]);
  }
  for (int64_t i = 0; i < count; ++i)
    for (int64_t r = 0; r < rows_of(i); ++r) {
      const float inv = 1.f / sums[i][r];
      const float* acc = s.acc.data() + i * acc_size + r * head_dim;
      float* dst = out + row_of(i, r);
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = acc[d] * inv;
    }
}
#else
constexpr bool kTiles = false;
#endif

}  // namespace

int64_t prefill_tile_tokens(int64_t group, int64_t head_dim) {
  if (!kTiles || group < 1 || group > kLanes / 2 || head_dim % 16 != 0) return 0;
  return kLanes / group;
}

void split_prefill_runs(int64_t num_tokens, const int32_t* seq_index, const int32_t* context_lens, int64_t tile_tokens,
                        std::vector<PrefillTile>& tiles, std::vector<int64_t>& singles) {
  tiles.clear();
  singles.clear();
  for (int64_t t = 0; t < num_tokens;) {
    int64_t end = t + 1;
    while (end < num_tokens && seq_index[end] == seq_index[t] && context_lens[end] == context_lens[end - 1] + 1) ++end;
    if (tile_tokens > 0 && context_lens[t] > 0 && end - t >= kMinTileRun) {
      for (int64_t first = t; first < end; first += tile_tokens)
        tiles.push_back({first, std::min(tile_tokens, end - first)});
    } else {
      for (int64_t s = t; s < end; ++s) singles.push_back(s);
    }
    t = end;
  }
}

template <typename C>
void attend_prefill_tiles(const std::vector<PrefillTile>& tiles, const float* q_rot, const C* k_cache,
                          const C* v_cache, const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_index,
                          const int32_t* context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, float* out) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  // An item: up to kTilesAnItem consecutive tiles of one run against one KV head, costing their rows times the
  // contexts their last tokens see.
  std::vector<int64_t> spans;  // each item's first tile; a span ends at the next's, or where its run does
  for (int64_t i = 0; i < static_cast<int64_t>(tiles.size()); ++i) {
    // Only tiles of one run: the batch's next rows, of the same sequence, at the next positions. attend_tiles sizes
    // an item's scores by its last tile's context; two runs of one sequence side by side in a batch (positions 40..55,
    // then 10..25: the op takes any order) made one item whose first tile wrote past them.
    const bool continues = i > 0 && i - spans.back() < kTilesAnItem &&
                           tiles[i].first == tiles[i - 1].first + tiles[i - 1].tokens &&
                           seq_index[tiles[i].first] == seq_index[tiles[i - 1].first] &&
                           context_lens[tiles[i].first] == context_lens[tiles[i].first - 1] + 1;
    if (!continues) spans.push_back(i);
  }
  spans.push_back(static_cast<int64_t>(tiles.size()));
  const int64_t num_spans = static_cast<int64_t>(spans.size()) - 1, items = num_spans * num_kv_heads;
  std::vector<int64_t> cost_before(items + 1, 0);
  for (int64_t item = 0; item < items; ++item) {
    int64_t cost = 0;
    for (int64_t i = spans[item / num_kv_heads]; i < spans[item / num_kv_heads + 1]; ++i)
      cost += tiles[i].tokens * (1 + context_lens[tiles[i].first + tiles[i].tokens - 1]);
    cost_before[item + 1] = cost_before[item] + cost;
  }
  balanced_for(items, [&](int64_t item) { return cost_before[item]; }, [&](const auto& next) {
    thread_local TileScratch scratch;
    for (int64_t item; next(item);) {
      const int64_t first = spans[item / num_kv_heads], count = spans[item / num_kv_heads + 1] - first;
      attend_tiles<C>(tiles.data() + first, count, item % num_kv_heads, q_rot, k_cache, v_cache,
                      block_tables + static_cast<int64_t>(seq_index[tiles[first].first]) * max_blocks, context_lens,
                      num_heads, num_kv_heads, head_dim, block_size, scale, out, scratch);
    }
  });
#else
  (void)tiles, (void)q_rot, (void)k_cache, (void)v_cache, (void)block_tables, (void)max_blocks, (void)seq_index,
      (void)context_lens, (void)num_heads, (void)num_kv_heads, (void)head_dim, (void)block_size, (void)scale,
      (void)out;
#endif
}

template void attend_prefill_tiles<float>(const std::vector<PrefillTile>&, const float*, const float*, const float*,
                                          const int32_t*, int64_t, const int32_t*, const int32_t*, int64_t, int64_t,
                                          int64_t, int64_t, float, float*);
template void attend_prefill_tiles<c10::Half>(const std::vector<PrefillTile>&, const float*, const c10::Half*,
                                              const c10::Half*, const int32_t*, int64_t, const int32_t*,
                                              const int32_t*, int64_t, int64_t, int64_t, int64_t, float, float*);
template void attend_prefill_tiles<c10::BFloat16>(const std::vector<PrefillTile>&, const float*,
                                                  const c10::BFloat16*, const c10::BFloat16*, const int32_t*, int64_t,
                                                  const int32_t*, const int32_t*, int64_t, int64_t, int64_t, int64_t,
                                                  float, float*);
template void attend_prefill_tiles<c10::Float8_e4m3fn>(const std::vector<PrefillTile>&, const float*,
                                                       const c10::Float8_e4m3fn*, const c10::Float8_e4m3fn*,
                                                       const int32_t*, int64_t, const int32_t*, const int32_t*,
                                                       int64_t, int64_t, int64_t, int64_t, float, float*);

}  // namespace neuronmm
