// A prefill chunk's attention a tile of tokens at a time (an fp32 model): neuronmm::attention's per-token loops read
// a token's whole context once per token, so a chunk's keys and values were read (and widened) once per token, at
// about a quarter of the FMA peak; a tile takes a cached block of keys or values against all of its query rows, as
// a GEMM takes a panel against a block of rows.
#pragma once

#include <cstdint>
#include <vector>

namespace neuronmm {

// A tile: a batch's consecutive tokens at consecutive positions of one sequence (part of a prefill chunk, or a
// speculative step's drafts).
struct PrefillTile {
  int64_t first;   // batch row of its first token
  int64_t tokens;  // how many
};

// Tokens a tile takes for heads of `head_dim` in groups of `group` query heads a KV head: its query rows (tokens x
// group) fill 16 lanes. 0 where the tiles do not apply: a build without AVX2 / FMA / F16C, a head width that is not a
// multiple of 16, a group of more than 8 heads.
int64_t prefill_tile_tokens(int64_t group, int64_t head_dim);

// The batch's tokens as tiles (every run of at least kMinTileRun consecutive positions of one sequence, cut into
// tiles of `tile_tokens`) and single tokens (the rest, in batch order). Tokens with no context are singles.
constexpr int64_t kMinTileRun = 4;
void split_prefill_runs(int64_t num_tokens, const int32_t* seq_index, const int32_t* context_lens, int64_t tile_tokens,
                        std::vector<PrefillTile>& tiles, std::vector<int64_t>& singles);

// Attention of every tile's tokens over their sequences' cached positions [0, context_lens[t]), from the rotated
// queries q_rot [num_tokens, num_heads, head_dim] into out (the same shape), in a balanced parallel region. The
// cache [num_blocks, num_kv_heads, block_size, head_dim] holds fp32, fp16, bf16 or fp8 e4m3fn (C). Their keys and
// values are already written (attention rotates and stores a step's before it attends).
template <typename C>
void attend_prefill_tiles(const std::vector<PrefillTile>& tiles, const float* q_rot, const C* k_cache,
                          const C* v_cache, const int32_t* block_tables, int64_t max_blocks, const int32_t* seq_index,
                          const int32_t* context_lens, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                          int64_t block_size, float scale, float* out);

}  // namespace neuronmm
