"""A compact Llama-family decoder whose forward runs a flat, mixed prefill/decode batch on a slot KV cache.

Why not transformers' LlamaForCausalLM: continuous batching needs one forward over ragged chunks
(prefill pieces and single decode tokens of different sequences) against a cache the engine owns;
doing that through HF's cache classes costs more Python than the model itself at decode sizes.
Weights, config and rotary tables still come from transformers, so outputs match HF.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


@dataclass
class FlatBatch:
    """A forward's inputs: every scheduled token of every sequence, concatenated.

    input_ids, positions: [num_tokens]; per sequence i: cache slot `slots[i]`, first position
    `starts[i]`, `lengths[i]` new tokens, and whether its last position needs logits.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    token_slots: torch.Tensor
    slots: list[int]
    starts: list[int]
    lengths: list[int]
    logits_index: torch.Tensor  # flat indices of the tokens whose logits are returned
    decode: "DecodeGroup | None" = None


@dataclass
class DecodeGroup:
    """Single-token (decode) sequences attended together over the slot range [slot_lo, slot_lo + num_rows).

    Slots are handed out lowest-first, so running sequences occupy a dense range and the cache view
    needs no copy; rows of the range that are not decoding this step are computed and discarded.
    """

    token_index: torch.Tensor  # [num_decode] flat positions of the decode tokens
    rows: torch.Tensor  # [num_decode] slot - slot_lo
    slot_lo: int
    num_rows: int
    max_len: int  # longest context among the decode sequences
    mask: torch.Tensor  # [num_rows, 1, 1, max_len] bool, True where a key is attended


def make_decode_group(slots: list[int], starts: list[int], lengths: list[int],
                      device: torch.device | str = "cpu") -> DecodeGroup | None:
    """Group the decode sequences of a batch (None when fewer than two: the per-sequence path is as fast)."""
    offsets, offset = [], 0
    for n in lengths:
        offsets.append(offset)
        offset += n
    dec = [(slots[i], starts[i], offsets[i]) for i in range(len(slots)) if lengths[i] == 1]
    if len(dec) < 2:
        return None
    lo, hi = min(d[0] for d in dec), max(d[0] for d in dec)
    max_len = max(d[1] for d in dec) + 1
    ctx = torch.ones(hi - lo + 1, dtype=torch.long)  # idle rows attend one key: no all-masked NaN rows
    for slot, start, _ in dec:
        ctx[slot - lo] = start + 1
    mask = (torch.arange(max_len).unsqueeze(0) < ctx.unsqueeze(1)).view(hi - lo + 1, 1, 1, max_len)
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    return DecodeGroup(as_long([d[2] for d in dec]), as_long([d[0] - lo for d in dec]), lo, hi - lo + 1,
                       max_len, mask.to(device))


class KVCache:
    """Per-layer K/V tensors [num_slots, num_kv_heads, max_model_len, head_dim]; one slot per sequence.

    Allocated with torch.empty: the OS commits pages only as positions are written, so the resident
    size follows the tokens actually cached rather than num_slots x max_model_len.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (num_slots, num_kv_heads, max_len, head_dim)
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self._finite_len = [0] * num_slots  # per slot: positions [0, n) hold finite values

    # Batched decode attends over padded rows; masked keys get weight 0, but 0 * NaN is NaN, so the
    # padding must never be uninitialised memory. Zero it lazily, a stride ahead, not all up front.
    _ZERO_STRIDE = 256

    def ensure_finite(self, slot_lo: int, num_rows: int, length: int) -> None:
        """Make positions [0, length) of slots [slot_lo, slot_lo + num_rows) safe to read.

        Zeroes only positions never made finite before, so it must run before the forward that writes
        them: positions already written always lie below the slot's finite length.
        """
        for slot in range(slot_lo, slot_lo + num_rows):
            done = self._finite_len[slot]
            if done >= length:
                continue
            end = min(self.max_len, max(length, done + self._ZERO_STRIDE))
            for t in self.k + self.v:
                t[slot, :, done:end].zero_()
            self._finite_len[slot] = end

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class RMSNorm(nn.Module):
    """Llama RMSNorm, computed in fp32 like the reference."""

    def __init__(self, hidden: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one fused op instead of five on the hot path
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


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

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [num_tokens, 1, head_dim] for the batch's positions (looked up once per forward)."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, heads, head_dim] by the tables of its positions."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate x [num_tokens, heads, head_dim] to its positions."""
        return self.rotate(x, *self.tables(positions, x.dtype))


def _fuse_linears(mods: list[nn.Module]) -> nn.Linear | None:
    """One Linear stacking the outputs of several bias-free Linears, or None if any is not one."""
    if not all(type(m) is nn.Linear and m.bias is None for m in mods):
        return None
    weight = torch.cat([m.weight.data for m in mods], dim=0)
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype, device=weight.device)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    return fused


class Attention(nn.Module):
    """GQA self-attention over a flat batch, writing new K/V into the slot cache."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)
        self.qkv_proj: nn.Linear | None = None
        self.scale = 1.0 / math.sqrt(self.head_dim)

    def fuse(self) -> None:
        self.qkv_proj = _fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        if self.qkv_proj is not None:  # drop the parts so weights are held once
            self.q_proj = self.k_proj = self.v_proj = None

    def _qkv(self, x: torch.Tensor):
        if self.qkv_proj is not None:
            q_dim, kv_dim = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            return self.qkv_proj(x).split([q_dim, kv_dim, kv_dim], dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def forward(self, x: torch.Tensor, batch: FlatBatch, rope: tuple[torch.Tensor, torch.Tensor],
                k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self._qkv(x)
        # q and k heads side by side: one rotation instead of two
        qk = Rotary.rotate(torch.cat([q, k], dim=-1).view(num_tokens, -1, self.head_dim), *rope)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        k_cache[batch.token_slots, :, batch.positions] = k
        v_cache[batch.token_slots, :, batch.positions] = v
        out = torch.empty_like(q)
        group = batch.decode
        if group is not None:
            self._attend_decode(q, out, group, k_cache, v_cache)
        offset = 0
        for slot, start, length in zip(batch.slots, batch.starts, batch.lengths):
            if group is None or length > 1:
                out[offset:offset + length] = self._attend_one(q[offset:offset + length], slot, start, length,
                                                               k_cache, v_cache)
            offset += length
        return self.o_proj(out.view(num_tokens, -1))


    def _attend_one(self, q: torch.Tensor, slot: int, start: int, length: int,
                    k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Attention of one sequence's new tokens q [length, heads, head_dim] over its cached prefix."""
        end = start + length
        mask = None
        if 1 < length < end:  # a prefill chunk after cached tokens: causal, shifted by start
            mask = torch.ones(length, end, dtype=torch.bool, device=q.device).tril(diagonal=start)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k_cache[slot, :, :end].unsqueeze(0), v_cache[slot, :, :end].unsqueeze(0),
            attn_mask=mask, is_causal=(length > 1 and start == 0), scale=self.scale, enable_gqa=True)
        return attn[0].transpose(0, 1)

    def _attend_decode(self, q: torch.Tensor, out: torch.Tensor, group: DecodeGroup,
                       k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """One SDPA for all decode tokens, over a no-copy view of their slot range."""
        rows = q.new_zeros(group.num_rows, self.num_heads, 1, self.head_dim)
        rows[group.rows] = q[group.token_index].unsqueeze(2)
        span = slice(group.slot_lo, group.slot_lo + group.num_rows)
        attn = F.scaled_dot_product_attention(
            rows, k_cache[span, :, :group.max_len], v_cache[span, :, :group.max_len],
            attn_mask=group.mask, scale=self.scale, enable_gqa=True)
        out[group.token_index] = attn[group.rows].squeeze(2)


class MLP(nn.Module):
    """SwiGLU MLP; gate/up/down may each be a Linear or a LowRankLinear."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj: nn.Module = nn.Linear(hidden, inter, bias=False)
        self.up_proj: nn.Module = nn.Linear(hidden, inter, bias=False)
        self.down_proj: nn.Module = nn.Linear(inter, hidden, bias=False)
        self.gate_up_proj: nn.Linear | None = None

    def fuse(self) -> None:
        self.gate_up_proj = _fuse_linears([self.gate_proj, self.up_proj])
        if self.gate_up_proj is not None:
            self.gate_proj = self.up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, batch, rope, k_cache, v_cache):
        x = x + self.self_attn(self.input_layernorm(x), batch, rope, k_cache, v_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm and LM head; forward returns logits of selected tokens."""

    def __init__(self, config: LlamaConfig, max_len: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config, max_len)
        self.requires_grad_(False)

    def fuse_projections(self) -> None:
        """Stack q/k/v and gate/up into single GEMMs where they are plain Linears (after any low-rank swap)."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()

    @torch.inference_mode()
    def forward(self, batch: FlatBatch, cache: KVCache) -> torch.Tensor:
        x = self.embed_tokens(batch.input_ids)
        rope = self.rotary.tables(batch.positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, batch, rope, cache.k[i], cache.v[i])
        x = self.norm(x[batch.logits_index])
        return self.lm_head(x).float()
