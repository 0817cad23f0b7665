"""What a loaded model's steps cost: the FLOPs a compute floor divides by the peak (bench.peak_rate), and the bytes a
memory floor divides by the read bandwidth (bench.read_bandwidth), its weights and the KV cache its attention reads;
a level's ceiling from both.

Counted from the modules the engine runs, as each computes: a dense linear in x out multiply-adds a token, a low-rank
one rank x (in + out), a factored panel call (csrc `factored_linear`) its first GEMM and its second ones. A multiply-add
counts two FLOPs. Attention adds QKᵀ and P·V over every cached position. A prompt token that is not its prompt's last
skips the LM head and, past its attention, the last layer (llama.cpp's graphs prune the same way; LlamaModel's
`output_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from server.models.lowrank import LowRankLinear
from server.models.packed_linear import FactoredPanelLinear

ATTENTION_INPUTS = ("qkv_proj", "q_proj", "k_proj", "v_proj")  # a layer's projections that run before attention


def module_macs(module: nn.Module) -> int | None:
    """Multiply-adds a token costs in one leaf module (None: not a linear layer)."""
    if isinstance(module, FactoredPanelLinear):
        seconds = sum(s * o for s, o, b in zip(module.splits, module.outs, module.seconds) if b is not None)
        return module.in_features * sum(module.splits) + seconds
    if isinstance(module, LowRankLinear):
        return module.rank * (module.in_features + module.out_features)
    ins, outs = getattr(module, "in_features", None), getattr(module, "out_features", None)
    return ins * outs if isinstance(ins, int) and isinstance(outs, int) else None


def linear_macs(model: nn.Module) -> dict[str, int]:
    """Multiply-adds a token costs in each linear layer of `model`, by module name (its leaf modules that are one)."""
    macs = {}
    for name, module in model.named_modules():
        if next(module.children(), None) is None and (count := module_macs(module)) is not None:
            macs[name] = count
    return macs


def weight_bytes(model: nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter and packed weight but the embedding table
    (a step reads a few of its rows; when tied, the LM head reads all of it once, counted there)."""
    seen, total = set(), 0
    for name, t in list(model.named_parameters()) + [(n, b) for n, b in model.named_buffers() if "rotary" not in n]:
        if id(t) in seen or name.startswith("embed_tokens"):
            continue
        seen.add(id(t))
        total += t.numel() * t.element_size()
    for module in model.modules():
        packed = module.panel_tensors() if hasattr(module, "panel_tensors") else [getattr(module, "packed", None)]
        for t in packed:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@dataclass(frozen=True)
class TokenArithmetic:
    """Multiply-adds a token costs one model: a decoded token, a pruned prompt token, attention per position."""

    decode_macs: int  # every linear layer and the LM head
    prompt_macs: int  # a prompt token that is not its prompt's last: no LM head, the last layer's QKV only
    attention_macs_per_position: int  # QKᵀ and P·V over one cached position, summed over the layers

    @classmethod
    def of(cls, model: nn.Module) -> TokenArithmetic:
        """Counted from a LlamaModel's leaf modules (names as LlamaModel gives them: layers.N..., lm_head)."""
        cfg = model.config
        last = f"layers.{cfg.num_hidden_layers - 1}."
        macs = linear_macs(model)
        pruned = [name for name in macs if name.startswith("lm_head") or
                  (name.startswith(last) and name.split(".")[-1] not in ATTENTION_INPUTS)]
        decode = sum(macs.values())
        prompt = decode - sum(macs[name] for name in pruned)
        attention = model.layers[0].self_attn
        return cls(decode, prompt, 2 * attention.num_heads * attention.head_dim * len(model.layers))

    def decode_step_flops(self, batch: int, context: int) -> float:
        """FLOPs of one decode step: `batch` tokens, each attending `context` positions."""
        return 2.0 * batch * (self.decode_macs + self.attention_macs_per_position * context)

    def request_flops(self, prompt_len: int, output_len: int) -> float:
        """FLOPs of serving one request: its prompt (causal attention), then output_len - 1 decode steps (the prompt's
        last token makes the first output token)."""
        positions = prompt_len * (prompt_len + 1) // 2 + decoded_positions(prompt_len, output_len)
        macs = ((prompt_len - 1) * self.prompt_macs + output_len * self.decode_macs
                + positions * self.attention_macs_per_position)
        return 2.0 * macs

    def level_flops(self, prompt_lens: Sequence[int], output_len: int) -> float:
        """FLOPs of serving every prompt to output_len tokens."""
        return sum(self.request_flops(n, output_len) for n in prompt_lens)


def decoded_positions(prompt_len: int, output_len: int) -> int:
    """Cached positions a request's decode steps read: each of its output_len - 1 decode tokens attends every position
    up to its own."""
    return sum(range(prompt_len + 1, prompt_len + output_len))


def level_kv_bytes(prompt_lens: Sequence[int], output_len: int, kv_bytes_per_position: int) -> float:
    """Bytes of KV cache a level's decode steps read (its prompts' own attention reads what it just wrote)."""
    return float(kv_bytes_per_position * sum(decoded_positions(n, output_len) for n in prompt_lens))


def min_level_steps(requests: int, concurrency: int, output_len: int) -> int:
    """The fewest steps a level can take: each wave of up to `concurrency` requests needs output_len of them (its
    prompts' step, then one a token)."""
    return math.ceil(requests / concurrency) * output_len


def ceiling_tok_s(output_tokens: int, gflop: float, peak: dict | None, steps: int = 0, step_bytes: float = 0.0,
                  bandwidth_gbs: float | None = None, kv_bytes: float = 0.0) -> float | None:
    """A level's output tok/s were it bound by its physical limits alone: all its `gflop` at `peak` ({"kind", "gops"}:
    bench.peak_rate; None: no ceiling), or, where longer, `steps` steps that each stream `step_bytes` of weights, and
    its decode steps' `kv_bytes` of KV cache, at `bandwidth_gbs` (a few requests' levels are bound by the stream; the
    last-level cache can keep part of the weights between steps, so such a level may pass it by a few %)."""
    if not peak:
        return None
    stream_s = (steps * step_bytes + kv_bytes) / (bandwidth_gbs * 1e9) if bandwidth_gbs else 0.0
    return output_tokens / max(gflop / peak["gops"], stream_s)


def ceiling_cell(value: float | None) -> str:
    """A table cell for a ceiling that may be missing (no peak probed for the model's GEMMs)."""
    return "-" if value is None else f"{value:.0f}"
