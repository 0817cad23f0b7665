// The decode step's layer loop in C++: every decoder layer of a model whose projections are all panel GEMMs, in
// one op call.
//
// Why: from Python a layer is seven op calls (qkv, attention, o, add + norm, gate/up, SiLU·mul, down + norm), and
// each pays ~2 µs of argument parsing and boxing on its way through the dispatcher, plus the interpreter between
// them: ~0.9 ms of an 11 ms batch-1 step of the default model. Here the same kernels run in the same order on the
// same values, called directly (csrc/step_ops.h) into buffers allocated once a step, so the result is bit for bit the
// Python loop's.
//
// A DecoderPlan holds what does not change between steps: each layer's four projections (as factored_linear
// arguments: a panel GEMM is one part that passes its output through) and its two norm weights.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "step_ops.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <vector>

namespace {

// y = x · Wᵀ as one factored_linear call: the first GEMM's panels, its splits, each split's second GEMM (none: the
// split passes through), and each part's output width.
struct Projection {
  at::Tensor first;
  std::vector<int64_t> splits;
  c10::List<std::optional<at::Tensor>> seconds;
  std::vector<int64_t> outs;
  int64_t first_width, out_width;  // sums of splits (the first GEMM's output t) and of outs (y)
};

// A Projection from factored_linear's arguments; an empty (0-element) second marks a split that passes through.
Projection make_projection(at::Tensor first, std::vector<int64_t> splits, std::vector<at::Tensor> seconds,
                           std::vector<int64_t> outs) {
  TORCH_CHECK(splits.size() == seconds.size() && splits.size() == outs.size() && !splits.empty(),
              "add_projection: one second and one output width per split");
  int64_t first_width = 0, out_width = 0;
  for (size_t i = 0; i < splits.size(); ++i) first_width += splits[i], out_width += outs[i];
  Projection p{std::move(first), std::move(splits), c10::List<std::optional<at::Tensor>>(), std::move(outs),
               first_width, out_width};
  for (auto& b : seconds) p.seconds.push_back(b.numel() == 0 ? std::nullopt : std::optional<at::Tensor>(std::move(b)));
  return p;
}

// A LoRA adapter's updates in the layer loop: four a layer (qkv, o, gate_up, down), each (x·Aᵀ)·Bᵀ as one
// factored_linear call added to that projection's output, or none where the adapter leaves the projection alone.
struct LoraPlan : torch::CustomClassHolder {
  std::vector<std::optional<Projection>> updates;

  void add_update(at::Tensor first, std::vector<int64_t> splits, std::vector<at::Tensor> seconds,
                  std::vector<int64_t> outs) {
    updates.push_back(make_projection(std::move(first), std::move(splits), std::move(seconds), std::move(outs)));
  }
  void add_none() { updates.push_back(std::nullopt); }
};

// What a family adds between a layer's QKV GEMM and rotary (undefined: nothing): Qwen2's [q | k | v] bias, Qwen3's
// per-head q and k norm weights.
struct AttentionExtras {
  at::Tensor qkv_bias, q_norm, k_norm;
};

// x's rows `rows` (int64), one after another: a plain copy a row (index_select took ~5 µs a call at a step's sizes).
at::Tensor gather_rows(const at::Tensor& x, const at::Tensor& rows) {
  const int64_t m = rows.size(0), width = x.size(1), bytes = width * x.element_size();
  at::Tensor out = at::empty({m, width}, x.options());
  const int64_t* index = rows.data_ptr<int64_t>();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  for (int64_t r = 0; r < m; ++r) std::memcpy(dst + r * bytes, src + index[r] * bytes, bytes);
  return out;
}

// y[rows[r]] += update[r] for each r, in y's dtype (fp32 or bf16, the sum rounded once, as add_ rounds it): ATen's
// index_add_ went through its scatter path, ~11 µs a call for a handful of rows.
void add_rows_(at::Tensor& y, const at::Tensor& rows, const at::Tensor& update) {
  const int64_t m = rows.size(0), width = y.size(1);
  const int64_t* index = rows.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, y.scalar_type(), "add_rows_", [&] {
    const scalar_t* u = update.data_ptr<scalar_t>();
    scalar_t* out = y.data_ptr<scalar_t>();
    for (int64_t r = 0; r < m; ++r) {
      scalar_t* row = out + index[r] * width;
      const scalar_t* add = u + r * width;
      for (int64_t c = 0; c < width; ++c)
        row[c] = static_cast<scalar_t>(static_cast<float>(row[c]) + static_cast<float>(add[c]));
    }
  });
}

struct DecoderPlan : torch::CustomClassHolder {
  int64_t num_heads, num_kv_heads;
  double scale, eps;
  std::vector<Projection> projections;  // four a layer: qkv, o, gate_up, down
  std::vector<at::Tensor> norms;        // two a layer: post-attention, then the next layer's input (the final norm last)
  std::vector<AttentionExtras> extras;  // one a layer, or none for a family without any
  int64_t scratch_width = 0;            // the widest first GEMM: one scratch t a step serves every projection

  DecoderPlan(int64_t num_heads, int64_t num_kv_heads, double scale, double eps)
      : num_heads(num_heads), num_kv_heads(num_kv_heads), scale(scale), eps(eps) {}

  // A projection's factored_linear arguments (make_projection).
  void add_projection(at::Tensor first, std::vector<int64_t> splits, std::vector<at::Tensor> seconds,
                      std::vector<int64_t> outs) {
    projections.push_back(make_projection(std::move(first), std::move(splits), std::move(seconds), std::move(outs)));
    scratch_width = std::max(scratch_width, projections.back().first_width);
  }

  void add_norms(at::Tensor post_attention, at::Tensor next) {
    norms.push_back(std::move(post_attention));
    norms.push_back(std::move(next));
  }

  // A layer's QKV bias and head norm weights, in layer order; an empty (0-element) tensor for one it lacks.
  void add_attention_extras(at::Tensor qkv_bias, at::Tensor q_norm, at::Tensor k_norm) {
    const auto defined = [](at::Tensor t) { return t.numel() == 0 ? at::Tensor() : std::move(t); };
    TORCH_CHECK((q_norm.numel() == 0) == (k_norm.numel() == 0), "DecoderPlan: q and k head norms come together");
    extras.push_back({defined(std::move(qkv_bias)), defined(std::move(q_norm)), defined(std::move(k_norm))});
  }

  int64_t num_layers() const { return static_cast<int64_t>(norms.size() / 2); }

  // Which layers rotate q and k (SmolLM3's skip it in some; unset: every layer does).
  void set_rotates(std::vector<int64_t> flags) { rotates = std::move(flags); }
  std::vector<int64_t> rotates;
};

// Every layer of the plan over the flat batch: x is the residual stream (updated in place), h its normed input to
// the first layer; returns the last layer's output through the final norm, for the rows `output_rows` names (every
// row where it is absent). The other arguments are LlamaModel.forward's. LoRA adapters add their updates to the
// rows each applies to: loras[g] to lora_rows[g] (every row where absent), past the last layer's pruning to
// lora_output_rows[g] (rows of the kept ones).
// Each op writes into buffers allocated once for the step (neuronmm::*_into): a layer's ops run one after another,
// so a buffer is reused by the next layer's same op.
at::Tensor decode_layers(const c10::intrusive_ptr<DecoderPlan>& plan, at::Tensor& x, const at::Tensor& h_in,
                         const at::Tensor& cos, const at::Tensor& sin, at::TensorList k_caches, at::TensorList v_caches,
                         const at::Tensor& slot_mapping, const at::Tensor& block_tables, const at::Tensor& seq_index,
                         const at::Tensor& context_lens, const std::optional<at::Tensor>& output_rows,
                         const std::optional<std::vector<c10::intrusive_ptr<LoraPlan>>>& lora_plans,
                         const std::optional<c10::List<std::optional<at::Tensor>>>& lora_row_lists,
                         const std::optional<c10::List<std::optional<at::Tensor>>>& lora_output_row_lists) {
  const int64_t layers = plan->num_layers();
  TORCH_CHECK(static_cast<int64_t>(plan->projections.size()) == 4 * layers, "decode_layers: four projections a layer");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "decode_layers: one K and one V cache a layer");
  TORCH_CHECK(x.dim() == 2 && layers > 0, "decode_layers: x [num_tokens, hidden] and at least one layer expected");
  TORCH_CHECK(plan->extras.empty() || static_cast<int64_t>(plan->extras.size()) == layers,
              "decode_layers: attention extras for every layer or for none");
  using RowLists = c10::List<std::optional<at::Tensor>>;
  const std::vector<c10::intrusive_ptr<LoraPlan>> loras = lora_plans.value_or(
      std::vector<c10::intrusive_ptr<LoraPlan>>());
  const RowLists lora_rows = lora_row_lists.value_or(RowLists()),
                 lora_output_rows = lora_output_row_lists.value_or(RowLists());
  TORCH_CHECK(lora_rows.size() == loras.size() && lora_output_rows.size() == loras.size(),
              "decode_layers: rows and output rows for every LoRA adapter");
  for (const auto& lora : loras)
    TORCH_CHECK(static_cast<int64_t>(lora->updates.size()) == 4 * layers, "decode_layers: four LoRA updates a layer");
  const int64_t M = x.size(0), head_dim = k_caches[0].size(3);
  const Projection* p0 = plan->projections.data();  // every layer's projections have the first layer's widths
  const auto opts = x.options();
  at::Tensor qkv = at::empty({M, p0[0].out_width}, opts), q_rot = at::empty({M, plan->num_heads, head_dim}, opts),
             attn = at::empty({M, plan->num_heads * head_dim}, opts), o = at::empty({M, p0[1].out_width}, opts),
             gate_up = at::empty({M, p0[2].out_width}, opts), act = at::empty({M, p0[2].out_width / 2}, opts),
             down = at::empty({M, p0[3].out_width}, opts), h = at::empty_like(x),
             t = at::empty({M * plan->scratch_width}, opts);  // (a dense model's calls leave it unused)
  bool past_pruning = false;  // the last layer's o, MLP and norm run on the kept rows alone
  // projection k (0 qkv, 1 o, 2 gate_up, 3 down) of layer i: y = in · Wᵀ, then each adapter's update of its rows
  const auto project = [&](int64_t i, int64_t k, const at::Tensor& in, at::Tensor& y) {
    const Projection& p = plan->projections[4 * i + k];
    neuronmm::factored_linear_into(in, p.first, p.splits, p.seconds, p.outs, y, t);
    for (size_t g = 0; g < loras.size(); ++g) {
      const std::optional<Projection>& u = loras[g]->updates[4 * i + k];
      if (!u.has_value()) continue;
      const std::optional<at::Tensor> rows = past_pruning ? lora_output_rows.get(g) : lora_rows.get(g);
      const at::Tensor x_rows = rows.has_value() ? gather_rows(in, *rows) : in;
      at::Tensor update = at::empty({x_rows.size(0), u->out_width}, y.options());
      neuronmm::factored_linear_into(x_rows, u->first, u->splits, u->seconds, u->outs, update, at::Tensor());
      if (rows.has_value()) add_rows_(y, *rows, update); else y.add_(update);
    }
  };
  TORCH_CHECK(plan->rotates.empty() || static_cast<int64_t>(plan->rotates.size()) == layers,
              "decode_layers: a rotary flag for every layer or for none");
  // a layer without rotary rotates by angle 0: cos 1 and sin 0 leave q and k as they are, bit for bit
  const bool some_still = std::find(plan->rotates.begin(), plan->rotates.end(), 0) != plan->rotates.end();
  const at::Tensor cos_still = some_still ? at::ones_like(cos) : at::Tensor(),
                   sin_still = some_still ? at::zeros_like(sin) : at::Tensor();
  // layer i's [q | k | v] of `in` (with its family's extras), rotary, its K/V into the cache, attention into attn
  const auto attend = [&](int64_t i, const at::Tensor& in) {
    at::Tensor k = k_caches[i], v = v_caches[i];  // handles to the caches: attention writes through them
    project(i, 0, in, qkv);
    if (!plan->extras.empty()) {
      const AttentionExtras& e = plan->extras[i];
      if (e.qkv_bias.defined()) qkv.add_(e.qkv_bias);
      if (e.q_norm.defined()) neuronmm::head_rms_norm_(qkv, e.q_norm, e.k_norm, plan->num_heads, plan->num_kv_heads,
                                                       plan->eps);
    }
    const bool rotates = plan->rotates.empty() || plan->rotates[i] != 0;
    neuronmm::attention_into(qkv, rotates ? cos : cos_still, rotates ? sin : sin_still, k, v, slot_mapping,
                             block_tables, seq_index, context_lens, plan->num_heads, plan->num_kv_heads, plan->scale,
                             q_rot, attn);
  };
  // the rest of layer i over the rows of `attn_rows` (and their residual `x_rows`, updated in place): the output
  // projection, the norm, the MLP and the next norm, into the buffers given (whole, or their first rows)
  const auto finish = [&](int64_t i, const at::Tensor& attn_rows, at::Tensor& x_rows, at::Tensor& o_, at::Tensor& gu,
                          at::Tensor& act_, at::Tensor& down_, at::Tensor& h_) {
    project(i, 1, attn_rows, o_);
    neuronmm::add_rms_norm_into(x_rows, o_, plan->norms[2 * i], plan->eps, h_);
    project(i, 2, h_, gu);
    neuronmm::silu_mul_into(gu, act_);
    project(i, 3, act_, down_);
    neuronmm::add_rms_norm_into(x_rows, down_, plan->norms[2 * i + 1], plan->eps, h_);
  };
  for (int64_t i = 0; i < layers - 1; ++i) {
    attend(i, i == 0 ? h_in : h);
    finish(i, attn, x, o, gate_up, act, down, h);
  }
  // The last layer: every row's K and V go to the cache, but past attention only the rows whose output is wanted
  // go on (a prompt chunk wants its last token's), as llama.cpp's graphs do: a 128-token chunk skips 84 % of a layer.
  attend(layers - 1, layers == 1 ? h_in : h);
  if (!output_rows.has_value() || output_rows->size(0) == M) {
    finish(layers - 1, attn, x, o, gate_up, act, down, h);
    return h;
  }
  const int64_t m = output_rows->size(0);
  past_pruning = true;
  at::Tensor rows_attn = attn.index_select(0, *output_rows);
  at::Tensor rows_x = x.index_select(0, *output_rows);  // those rows' residual (x's others are not read again)
  // the first m rows of each buffer: contiguous views
  at::Tensor o_m = o.narrow(0, 0, m), gate_up_m = gate_up.narrow(0, 0, m), act_m = act.narrow(0, 0, m),
             down_m = down.narrow(0, 0, m), h_m = h.narrow(0, 0, m);
  if (m > 0) finish(layers - 1, rows_attn, rows_x, o_m, gate_up_m, act_m, down_m, h_m);  // (0: no chunk ends a prompt)
  return h_m;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(neuronmm, m) {
  m.class_<DecoderPlan>("DecoderPlan")
      .def(torch::init<int64_t, int64_t, double, double>())
      .def("add_projection", &DecoderPlan::add_projection)
      .def("add_norms", &DecoderPlan::add_norms)
      .def("add_attention_extras", &DecoderPlan::add_attention_extras)
      .def("set_rotates", &DecoderPlan::set_rotates)
      .def("num_layers", &DecoderPlan::num_layers);
  m.class_<LoraPlan>("LoraPlan")
      .def(torch::init<>())
      .def("add_update", &LoraPlan::add_update)
      .def("add_none", &LoraPlan::add_none);
  m.def(
      "decode_layers(__torch__.torch.classes.neuronmm.DecoderPlan plan, Tensor(a!) x, Tensor h, Tensor cos, "
      "Tensor sin, Tensor(b!)[] k_caches, Tensor(c!)[] v_caches, Tensor slot_mapping, Tensor block_tables, "
      "Tensor seq_index, Tensor context_lens, Tensor? output_rows=None, "
      "__torch__.torch.classes.neuronmm.LoraPlan[]? loras=None, Tensor?[]? lora_rows=None, "
      "Tensor?[]? lora_output_rows=None) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(neuronmm, CPU, m) { m.impl("decode_layers", &decode_layers); }
