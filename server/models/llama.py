"""A compact Llama-family decoder whose forward runs a flat, mixed prefill/decode batch on a slot KV cache.

Why not transformers' LlamaForCausalLM: continuous batching needs one forward over ragged chunks
(prefill pieces and single decode tokens of different sequences) against a cache the engine owns;
doing that through HF's cache classes costs more Python than the model itself at decode sizes.
Weights, config and rotary tables still come from transformers, so outputs match HF.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from server.models.fused_ops import REFERENCE_KERNELS, Kernels
from server.models.hugepages import commit_in_rows, empty_in_huge_pages
from server.models.lora import LoraRows, with_lora
from server.models.lowrank import LowRankLinear
from server.models.module_init import linear_around


@dataclass
class FlatBatch:
    """A forward's inputs: every scheduled token of every sequence, concatenated (num_tokens in all).

    Per token: its id, position, cache slot (block * block_size + offset), the row of `block_tables`
    of its sequence, and how many cached positions the fused attention reads for it (0: the token
    belongs to a long prefill chunk, attended by SDPA through `sdpa_chunks` instead).
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    seq_index: torch.Tensor  # [num_tokens] int32
    context_lens: torch.Tensor  # [num_tokens] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    logits_index: torch.Tensor | None  # flat indices of the tokens whose logits are returned (None: every token's)
    sdpa_chunks: list["PrefillChunk"] = field(default_factory=list)
    lora: list[LoraRows] = field(default_factory=list)  # the rows each LoRA adapter of the step applies to


@dataclass
class PrefillChunk:
    """A prefill chunk long enough that SDPA beats the per-token fused attention."""

    offset: int  # first flat token index
    length: int
    seq_row: int  # row of block_tables
    start: int  # position of its first token


class KVCache:
    """Per-layer K/V tensors [num_blocks, num_kv_heads, block_size, head_dim].

    Attention reads only positions already written, so no value needs initialising. On CPU all layers
    share one mapping on huge pages (a batch's blocks lie scattered over the pool: 2 MiB pages spare a
    TLB miss on most of them), committed as vLLM and llama.cpp hold their caches: a first write to a fresh
    page costs the kernel (and a VM's host) ~1.5-3 ms, and a prefill step whose blocks crossed into fresh
    pages of all 60 layer tensors stalled 170-360 ms. The first blocks of every layer are backed when the
    cache is made and the rest by a background thread in block order (`committing`, hugepages.commit_in_rows);
    the engine checks that the pool fits the memory before it makes it (server.runtime.allocate_kv).
    """

    def __init__(self, num_layers: int, num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.committing: threading.Thread | None = None  # the thread backing the later blocks (None: none was needed)
        if torch.device(device).type == "cpu":
            tensors = empty_in_huge_pages([shape] * (2 * num_layers), dtype)
            self.committing = commit_in_rows(tensors)
        else:
            tensors = [torch.empty(shape, dtype=dtype, device=device) for _ in range(2 * num_layers)]
        self.k, self.v = tensors[:num_layers], tensors[num_layers:]
        self.num_blocks = num_blocks
        self.block_size = block_size

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu  # returns (out, logsumexp)


class RMSNorm(nn.Module):
    """Llama RMSNorm (HF's rounding: normalise in fp32, scale in the model dtype); the model calls the kernel."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps


class Rotary(nn.Module):
    """cos/sin tables for every position up to max_len, built by transformers' rope functions."""

    def __init__(self, config: LlamaConfig, max_len: int):
        super().__init__()
        params = getattr(config, "rope_parameters", None) or {"rope_type": "default"}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            head_dim = config.head_dim
            base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            scaling = 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, head_dim] for the batch's positions, in the model dtype (as HF casts them)."""
        cos, sin = self._in_dtype(dtype)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def _in_dtype(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole tables cast to `dtype` once (the same values as casting the rows a step reads: two ops a step
        fewer, each ~20-40 µs cold at the start of a decode step)."""
        cast = self._cast.get(dtype)
        if cast is None or cast[2] is not self.cos:  # cast from these tables (Module.to replaces buffers)
            cast = self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype), self.cos)
        return cast[0], cast[1]


def _fuse_linears(mods: list[nn.Module]) -> nn.Linear | None:
    """One Linear stacking the outputs of several bias-free Linears, or None if any is not one."""
    if not all(type(m) is nn.Linear and m.bias is None for m in mods):
        return None
    return linear_around(torch.cat([m.weight.data for m in mods], dim=0))


class StackedPair(nn.Module):
    """Gate and up (two projections of one input, at least one low-rank) sharing one first GEMM.

    The first GEMM stacks each part's first factor (A of a LowRankLinear, the weight of a Linear); the
    low-rank parts then apply their B. Output: [gate, up] as the fused dense GEMM would give it.
    """

    def __init__(self, first: nn.Module, second: nn.Module):
        super().__init__()
        heads = [m.A if isinstance(m, LowRankLinear) else m.weight for m in (first, second)]
        self.splits = [h.shape[0] for h in heads]
        self.A = linear_around(torch.cat([h.data for h in heads]))
        self.B0, self.B1 = (_second_factor(m) for m in (first, second))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts = list(self.A(x).split(self.splits, dim=-1))
        for i, factor in enumerate((self.B0, self.B1)):
            if factor is not None:
                parts[i] = factor(parts[i])
        return torch.cat(parts, dim=-1)


def _second_factor(module: nn.Module) -> nn.Linear | None:
    """B of a LowRankLinear as a Linear (packable), None for a dense Linear."""
    if not isinstance(module, LowRankLinear):
        return None
    return linear_around(module.B.data)


def _stack_pair(first: nn.Module, second: nn.Module) -> StackedPair | None:
    """A StackedPair for bias-free Linear/LowRankLinear parts with at least one low-rank, else None."""
    kinds = [type(m) is nn.Linear or isinstance(m, LowRankLinear) for m in (first, second)]
    if not all(kinds) or any(m.bias is not None for m in (first, second)):
        return None
    if not any(isinstance(m, LowRankLinear) for m in (first, second)):
        return None
    return StackedPair(first, second)


class Attention(nn.Module):
    """GQA self-attention over a flat batch: QKV GEMM, fused rotary + cache write + attention, output GEMM.

    Two family variants sit between the QKV GEMM and rotary: Qwen2's q/k/v biases, added after the bias-free
    GEMM (so it stays one packed call), and Qwen3's RMSNorm of each query and key head over head_dim.
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        qkv_bias = config.model_type == "qwen2"  # Qwen2 biases q, k and v (not o), whatever its config says
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.qkv_proj: nn.Linear | None = None
        self.qkv_bias: nn.Parameter | None = None  # [q | k | v] biases once fused
        if config.model_type == "qwen3":
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.kernels = REFERENCE_KERNELS  # the model's, for the head norms (LlamaModel.use_kernels sets them)

    @property
    def plain(self) -> bool:
        """Whether the QKV projection is the GEMM alone (no bias, no head norms): what csrc/decoder.cpp runs."""
        return self.qkv_bias is None and self.q_norm is None and (self.q_proj is None or self.q_proj.bias is None)

    def fuse(self) -> None:
        parts = [self.q_proj, self.k_proj, self.v_proj]
        biases = [m.bias for m in parts]
        if any(b is not None for b in biases):  # stack the weights bias-free; the biases are added after the GEMM
            self.qkv_bias = nn.Parameter(torch.cat([b.data for b in biases]), requires_grad=False)
            parts = [linear_around(m.weight.data) for m in parts]
        self.qkv_proj = _fuse_linears(parts)
        if self.qkv_proj is not None:  # drop the parts so weights are held once
            self.q_proj = self.k_proj = self.v_proj = None
        else:
            self.qkv_bias = None

    def project_qkv(self, x: torch.Tensor) -> torch.Tensor:
        """[q | k | v] of x, biased and head-normed where the family does: one GEMM once fused, else three."""
        return self.finish_qkv(self.qkv_gemm(x))

    def qkv_gemm(self, x: torch.Tensor) -> torch.Tensor:
        """[q | k | v] of x as the projections give it (unfused q/k/v keep their own biases)."""
        if self.qkv_proj is None:
            return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        return self.qkv_proj.forward(x)

    def extras(self) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """What follows the QKV GEMM: the [q | k | v] bias, the q and k head norm weights (None where absent)."""
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        return self.qkv_bias, *norms

    def qkv_call(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """What the step calls for [q | k | v]: the fused GEMM's own forward where nothing follows it."""
        return self.qkv_proj.forward if self.qkv_proj is not None and self.plain else self.project_qkv

    def finish_qkv(self, qkv: torch.Tensor) -> torch.Tensor:
        """What follows the QKV GEMM, in place: the family's bias, then its head norms."""
        if self.qkv_bias is not None:
            qkv.add_(self.qkv_bias)
        if self.q_norm is not None:
            self.kernels.head_rms_norm_(qkv, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.num_kv_heads,
                                        self.q_norm.eps)
        return qkv

    def attend_sdpa_chunks(self, out: torch.Tensor, q_rot: torch.Tensor, batch: FlatBatch, k_cache: torch.Tensor,
                           v_cache: torch.Tensor) -> None:
        """Fill the rows of `out` that belong to the batch's SDPA prefill chunks (the fused op left them zero)."""
        for chunk in batch.sdpa_chunks:
            span = slice(chunk.offset, chunk.offset + chunk.length)
            out[span] = self._attend_chunk(q_rot[span], chunk, batch.block_tables[chunk.seq_row], k_cache, v_cache)

    def _attend_chunk(self, q: torch.Tensor, chunk: PrefillChunk, table: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of one prefill chunk q [length, heads, head_dim] over its sequence's cached prefix."""
        end = chunk.start + chunk.length
        block_size = k_cache.shape[2]
        blocks = table[:(end + block_size - 1) // block_size].long()
        keys, values = (c[blocks].transpose(0, 1).reshape(self.num_kv_heads, -1, self.head_dim)[:, :end].to(q.dtype)
                        for c in (k_cache, v_cache))
        if q.device.type != "cpu":
            return self._attend_chunk_masked(q, chunk, keys, values)
        # CPU flash attention has no causal-with-offset mask (a boolean mask falls back to the slow math
        # path): attend the cached prefix without a mask and the chunk causally, then merge the two
        # softmaxes by their log-sum-exps.
        group = self.num_heads // self.num_kv_heads
        keys, values = (t.repeat_interleave(group, dim=0).unsqueeze(0) for t in (keys, values))
        q = q.transpose(0, 1).unsqueeze(0)  # [1, heads, length, head_dim]
        out, lse = _flash(q, keys[:, :, chunk.start:], values[:, :, chunk.start:], 0.0, True, scale=self.scale)
        if chunk.start > 0:
            prefix, prefix_lse = _flash(q, keys[:, :, :chunk.start], values[:, :, :chunk.start], 0.0, False,
                                        scale=self.scale)
            top = torch.maximum(lse, prefix_lse)
            w, w_prefix = (lse - top).exp().unsqueeze(-1), (prefix_lse - top).exp().unsqueeze(-1)
            out = ((out.float() * w + prefix.float() * w_prefix) / (w + w_prefix)).to(q.dtype)
        return out[0].transpose(0, 1).reshape(chunk.length, -1)

    def _attend_chunk_masked(self, q: torch.Tensor, chunk: PrefillChunk, keys: torch.Tensor,
                             values: torch.Tensor) -> torch.Tensor:
        """The same with one SDPA call and an explicit causal mask (devices other than the CPU)."""
        mask = None
        if chunk.start > 0:
            mask = torch.ones(chunk.length, chunk.start + chunk.length, dtype=torch.bool,
                              device=q.device).tril(diagonal=chunk.start)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask,
                                              is_causal=chunk.start == 0, scale=self.scale, enable_gqa=True)
        return attn.transpose(0, 1).reshape(chunk.length, -1)


class MLP(nn.Module):
    """SwiGLU MLP; gate/up/down may each be a Linear or a LowRankLinear."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj: nn.Module = nn.Linear(hidden, inter, bias=False)
        self.up_proj: nn.Module = nn.Linear(hidden, inter, bias=False)
        self.down_proj: nn.Module = nn.Linear(inter, hidden, bias=False)
        self.gate_up_proj: nn.Module | None = None

    def fuse(self) -> None:
        self.gate_up_proj = (_fuse_linears([self.gate_proj, self.up_proj])
                             or _stack_pair(self.gate_proj, self.up_proj))
        if self.gate_up_proj is not None:
            self.gate_proj = self.up_proj = None

    def project_gate_up(self, x: torch.Tensor) -> torch.Tensor:
        """[gate | up] of x: one call once fused or stacked, else two GEMMs and a concatenation."""
        if self.gate_up_proj is not None:
            return self.gate_up_proj.forward(x)
        return torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block (the model runs it: residual adds are fused with the next norm)."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


@dataclass(frozen=True, slots=True)
class LayerCalls:
    """One decoder layer as the step calls it: its projections as bound callables and its norm weights.

    Looked up once (LlamaModel.layer_calls) rather than per step: through nn.Module attribute lookups and two
    methods a layer, the default model's batch-1 decode step spent 1.1 ms in Python between its ops (0.6 ms now).
    """

    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    post_attention_norm: torch.Tensor
    next_norm: torch.Tensor  # the next layer's input norm; the final norm after the last layer
    attention: Attention  # head counts, scale, and the SDPA path for long prefill chunks


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; forward returns logits of selected tokens.

    The step calls its submodules' `forward` directly: nn.Module.__call__ (hook checks) costs ~2 µs, and
    a step makes ~180 such calls (0.4 ms of a 7 ms batch-1 decode step). No hooks are ever registered.
    It reaches the layers through `layer_calls()`, bound at the first forward: modules swapped after that
    (fuse_projections, use_kernels, packing) must call `unbind()`, as those three do. Where the fused C++ ops run
    the step and every projection is a panel GEMM, all layers run in one call instead (`decoder_plan()`,
    csrc/decoder.cpp): the same ops in the same order, without ~2 µs of dispatch per op and the loop between them.
    """

    def __init__(self, config: LlamaConfig, max_len: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config, max_len)
        # SmolLM3's layers without rotary (no_rope_layers: 0 where a layer skips it); every other family rotates in all
        self.rotates = [bool(r) for r in getattr(config, "no_rope_layers", None) or [1] * config.num_hidden_layers]
        self.kernels = REFERENCE_KERNELS
        self._layer_calls: list[LayerCalls] | None = None
        self.use_decoder_plan = True  # run the layers in C++ where decoder_plan() allows (off: the Python loop)
        self._decoder_plan: torch.ScriptObject | None | bool = False  # False: not built yet
        self.last_hidden: torch.Tensor | None = None  # the last forward's final-normed rows (those with logits)
        self.requires_grad_(False)

    def fuse_projections(self) -> None:
        """Stack q/k/v and gate/up into single GEMMs where they are plain Linears (after any low-rank swap)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        self.unbind()

    def use_kernels(self, kernels: Kernels) -> None:
        """Run the small ops through `kernels` (the fused CPU ops, or the torch references)."""
        self.kernels = kernels
        for layer in self.layers:
            layer.self_attn.kernels = kernels
        self.unbind()

    def unbind(self) -> None:
        """Forget the bound layer calls and the decoder plan (after swapping modules); the next forward binds them again."""
        self._layer_calls = None
        self._decoder_plan = False

    def decoder_plan(self) -> torch.ScriptObject | None:
        """Every layer as one csrc/decoder.cpp DecoderPlan, built once; None unless the step runs the fused C++ ops
        and every projection is a panel GEMM (then the Python loop runs the layers)."""
        if self._decoder_plan is False:
            self._decoder_plan = self._build_decoder_plan()
        return self._decoder_plan

    def _build_decoder_plan(self) -> torch.ScriptObject | None:
        if self.kernels.decode_layers is None:
            return None
        projections = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for module in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if not hasattr(module, "factored_args"):  # unfused, or not a panel GEMM
                    return None
                projections.append(module.factored_args())
        attn = self.layers[0].self_attn
        plan = torch.classes.neuronmm.DecoderPlan(attn.num_heads, attn.num_kv_heads, attn.scale, self.config.rms_norm_eps)
        no_second = torch.empty(0)
        for first, splits, seconds, outs in projections:
            plan.add_projection(first, splits, [no_second if b is None else b for b in seconds], outs)
        for calls in self.layer_calls():
            plan.add_norms(calls.post_attention_norm, calls.next_norm)
        if not all(layer.self_attn.plain for layer in self.layers):  # Qwen2's biases, Qwen3's head norms
            for layer in self.layers:
                plan.add_attention_extras(*(no_second if t is None else t for t in layer.self_attn.extras()))
        if not all(self.rotates):  # SmolLM3's layers without rotary
            plan.set_rotates([int(r) for r in self.rotates])
        return plan

    def layer_calls(self) -> list[LayerCalls]:
        """Each layer's projections and norms, bound once."""
        if self._layer_calls is None:
            layers = list(self.layers)
            next_norms = [layer.input_layernorm.weight for layer in layers[1:]] + [self.norm.weight]
            self._layer_calls = [self._calls_of(layer, next_norm) for layer, next_norm in zip(layers, next_norms)]
        return self._layer_calls

    @staticmethod
    def _calls_of(layer: DecoderLayer, next_norm: torch.Tensor) -> LayerCalls:
        attn, mlp = layer.self_attn, layer.mlp
        # a fused projection's own forward; unfused, the method that composes it
        qkv = attn.qkv_call()
        gate_up = mlp.gate_up_proj.forward if mlp.gate_up_proj is not None else mlp.project_gate_up
        return LayerCalls(qkv, attn.o_proj.forward, gate_up, mlp.down_proj.forward,
                          layer.post_attention_layernorm.weight, next_norm, attn)

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        kernels, eps = self.kernels, self.config.rms_norm_eps
        x = self.embed_tokens(batch.input_ids)  # the residual stream, updated in place by add_rms_norm
        cos, sin = self.rotary.tables(batch.positions, x.dtype)
        h = kernels.rms_norm(x, self.layers[0].input_layernorm.weight, eps)
        attention, add_rms_norm, silu_mul = kernels.attention, kernels.add_rms_norm, kernels.silu_mul
        tables, slots, seq_index, lens = batch.block_tables, batch.slot_mapping, batch.seq_index, batch.context_lens
        rows = batch.logits_index
        in_cpp = not batch.sdpa_chunks and all(g.adapter.plan is not None for g in batch.lora)
        plan = self.decoder_plan() if self.use_decoder_plan and in_cpp else None
        if plan is not None:  # the same ops in the same order, in one call (csrc/decoder.cpp)
            if batch.lora:
                h = kernels.decode_layers(plan, x, h, cos, sin, cache.k, cache.v, slots, tables, seq_index, lens, rows,
                                          [g.adapter.plan for g in batch.lora], [g.rows for g in batch.lora],
                                          [g.out_rows for g in batch.lora])
            else:
                h = kernels.decode_layers(plan, x, h, cos, sin, cache.k, cache.v, slots, tables, seq_index, lens, rows)
            return self._logits(h)
        calls = self.layer_calls() if not batch.lora else self._calls_with_lora(batch.lora, rows is not None)
        # a layer without rotary rotates by angle 0: cos 1 and sin 0 leave q and k as they are, bit for bit
        still = (torch.ones_like(cos), torch.zeros_like(sin)) if not all(self.rotates) else None
        for layer, k_cache, v_cache, rotates in zip(calls, cache.k, cache.v, self.rotates):
            attn = layer.attention
            c, s = (cos, sin) if rotates else still
            out, q_rot = attention(layer.qkv(h), c, s, k_cache, v_cache, slots, tables, seq_index, lens,
                                   attn.num_heads, attn.num_kv_heads, attn.scale)
            if batch.sdpa_chunks:
                attn.attend_sdpa_chunks(out, q_rot, batch, k_cache, v_cache)
            if rows is not None and layer is calls[-1]:
                # past the last layer's attention (every row's K/V is cached by now) only the rows that want
                # logits go on: a prompt chunk's last token (as llama.cpp's graphs prune the last layer)
                out, x = out[rows], x[rows]
            h = add_rms_norm(x, layer.o(out), layer.post_attention_norm, eps)
            h = add_rms_norm(x, layer.down(silu_mul(layer.gate_up(h))), layer.next_norm, eps)
        return self._logits(h)

    def _calls_with_lora(self, groups: list[LoraRows], pruned: bool) -> list[LayerCalls]:
        """The layer calls with a step's LoRA updates added to their projections (the last layer's o, gate/up and
        down over the rows its pruning keeps, when it prunes)."""
        calls = []
        last = len(self.layers) - 1
        for i, (layer, base) in enumerate(zip(self.layers, self.layer_calls())):
            def updates(slot: int, out: bool = False) -> list:
                return [(g.adapter.deltas[(i, slot)], g.out_rows if out else g.rows)
                        for g in groups if (i, slot) in g.adapter.deltas]

            attn, past_pruning, qkv_updates = layer.self_attn, pruned and i == last, updates(0)
            # the update goes in before the family's bias and head norms, as HF's q/k/v projections carry it
            qkv = _then(with_lora(attn.qkv_gemm, qkv_updates), attn.finish_qkv) if qkv_updates else base.qkv
            calls.append(replace(base, qkv=qkv,
                                 o=with_lora(base.o, updates(1, past_pruning)),
                                 gate_up=with_lora(base.gate_up, updates(2, past_pruning)),
                                 down=with_lora(base.down, updates(3, past_pruning))))
        return calls

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """fp32 logits of the final-normed rows h, which stay readable as `last_hidden` (embeddings pool them)."""
        self.last_hidden = h
        return self.lm_head(h).float()


def _then(first: Callable[[torch.Tensor], torch.Tensor], second: Callable[[torch.Tensor], torch.Tensor]
          ) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: second(first(x))
