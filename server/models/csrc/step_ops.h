// The decode step's ops writing into tensors their caller holds: csrc/decoder.cpp allocates a step's buffers once
// and runs every layer's ops into them, where the registered ops (which allocate their outputs) cost an allocation
// and a dispatch per output, each cold at a decode step (the weights stream through the caches between calls).
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/List.h>

#include <optional>

namespace neuronmm {

// neuronmm::attention, its outputs q_rot [num_tokens, heads, head_dim] and out [num_tokens, heads * head_dim] given.
void attention_into(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                    const at::Tensor& seq_index, const at::Tensor& context_lens, int64_t num_heads,
                    int64_t num_kv_heads, double scale, at::Tensor& q_rot, at::Tensor& out);

// neuronmm::add_rms_norm (x += y in place), the normed rows into `out`.
void add_rms_norm_into(at::Tensor& x, const at::Tensor& y, const at::Tensor& weight, double eps, at::Tensor& out);

// Qwen3's per-head q/k RMSNorm in place on qkv [num_tokens, (q + k + v heads) x head_dim] (neuronmm::head_rms_norm_).
void head_rms_norm_(at::Tensor& qkv, const at::Tensor& q_weight, const at::Tensor& k_weight, int64_t num_q_heads,
                    int64_t num_kv_heads, double eps);

// neuronmm::silu_mul into `out` [num_tokens, inter].
void silu_mul_into(const at::Tensor& gate_up, at::Tensor& out);

// neuronmm::factored_linear into `y` [M, sum(out_features)]; `scratch` holds the first GEMM's output t where the call
// needs one (at least M x sum(splits) elements of x's dtype; undefined: allocated here).
void factored_linear_into(const at::Tensor& x, const at::Tensor& first, at::IntArrayRef splits,
                          const c10::List<std::optional<at::Tensor>>& seconds, at::IntArrayRef outs, at::Tensor& y,
                          const at::Tensor& scratch);

}  // namespace neuronmm
