"""LoRA adapters served over one base model (vLLM's --lora-modules): PEFT folders (or llama.cpp GGUF adapters) read
once, applied per row.

An adapter adds scale · B·A to some of a layer's seven projections. The served model fuses q/k/v and gate/up into
one GEMM each, so an adapter is held in that shape too: per layer and fused projection, one A stacking its parts'
A and one block-diagonal B (the scale folded in) whose output columns are the fused GEMM's. A step whose rows use
adapters adds, for each adapter, (x[rows]·Aᵀ)·Bᵀ into those rows of the projection's output: two small GEMMs a
projection and adapter, whatever mix of adapters and base rows the batch holds (S-LoRA's and Punica's point: the
base GEMM stays one batched call).
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from safetensors.torch import load_file

from server.errors import ConfigError
from server.models.lora_gguf import read_gguf_adapter
from server.models.lora_paths import adapter_format

log = logging.getLogger(__name__)

# the fused projections a layer calls, and the HF modules each stacks (in its output order)
FUSED_PARTS = (("qkv", ("q_proj", "k_proj", "v_proj")), ("o", ("o_proj",)), ("gate_up", ("gate_proj", "up_proj")),
               ("down", ("down_proj",)))
_MODULES = {m: (slot, i) for slot, (_, parts) in enumerate(FUSED_PARTS) for i, m in enumerate(parts)}
_KEY = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_FILES = ("adapter_model.safetensors", "adapter_model.bin")
_LOADS = itertools.count(1)




@dataclass(frozen=True)
class LoraDelta:
    """One fused projection's update: y += (x·Aᵀ)·Bᵀ, A [rank, in], B [out, rank] (block-diagonal over the parts).

    `packed` holds the factors packed for the panel GEMM where the runner packed them (a FactoredPanelLinear: both
    GEMMs in one call, where torch's two small GEMMs took ~25 µs each, and a step makes four pairs a layer)."""

    A: torch.Tensor
    B: torch.Tensor
    packed: nn.Module | None = None

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """(x·Aᵀ)·Bᵀ for x's rows."""
        return self.packed.forward(x) if self.packed is not None else F.linear(F.linear(x, self.A), self.B)

    def add_to(self, y: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Add the update of x's `rows` (every row: None) into the same rows of y, in place."""
        if rows is None:
            y.add_(self.update(x))
        else:
            y.index_add_(0, rows, self.update(x.index_select(0, rows)))


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter as the served model applies it: (layer, fused projection) -> LoraDelta."""

    name: str
    path: Path
    rank: int  # the largest rank of its modules
    deltas: dict[tuple[int, int], LoraDelta]
    uid: int  # this load's own number: a folder loaded again under the same name shares no cached K/V with the last
    # its updates for the C++ layer loop (csrc/decoder.cpp LoraPlan), where the runner built one; None: the Python loop
    plan: object | None = None

    def to(self, device: torch.device | str) -> LoraAdapter:
        """The adapter with its factors on `device` (packed updates and plan dropped: the runner builds them there)."""
        return replace(self, deltas={k: LoraDelta(d.A.to(device), d.B.to(device)) for k, d in self.deltas.items()},
                       plan=None)

    def with_packed_updates(self, pack: Callable[[torch.Tensor, torch.Tensor], nn.Module | None]) -> LoraAdapter:
        """The adapter with each update computed by the module pack(A, B) gives (where it gives one)."""
        return replace(self, deltas={k: replace(d, packed=pack(d.A, d.B)) for k, d in self.deltas.items()})

    def with_plan(self, plan: object) -> LoraAdapter:
        """The adapter with its C++ layer loop plan (csrc/decoder.cpp LoraPlan)."""
        return replace(self, plan=plan)


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the module name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    for name in _FILES:
        file = folder / name
        if file.is_file():
            try:
                if name.endswith(".safetensors"):
                    return load_file(file)
                return torch.load(file, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - safetensors' and pickle's errors share no base class
                raise ConfigError(f"LoRA adapter {folder}: cannot read {name} ({exc.__class__.__name__}: "
                                  f"{str(exc).splitlines()[0] if str(exc) else ''})") from None
    raise ConfigError(f"LoRA adapter {folder}: no {' or '.join(_FILES)}")


def _read_config(folder: Path) -> dict:
    file = folder / "adapter_config.json"  # (adapter_format saw it)
    try:
        config = json.loads(file.read_text())
    except ValueError as exc:
        raise ConfigError(f"LoRA adapter {folder}: adapter_config.json is not JSON ({exc})") from None
    unsupported = {"peft_type": config.get("peft_type", "LORA") != "LORA", "bias": config.get("bias", "none") != "none"}
    unsupported.update({key: config.get(key) for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "lora_bias",
                                                        "trainable_token_indices", "layer_replication",
                                                        "target_parameters")})
    clash = [key for key, bad in unsupported.items() if bad]
    if clash:
        raise ConfigError(f"LoRA adapter {folder}: {clash[0]} = {config.get(clash[0])!r} is not supported "
                          "(a plain LoRA of the attention and MLP projections is)")
    return config


def load_lora_adapter(name: str, folder: Path, model_config, dtype: torch.dtype, max_rank: int) -> LoraAdapter:
    """Read a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors), or a llama.cpp GGUF LoRA file, for
    the served model; a ConfigError names what does not fit (a module other than the seven projections, a shape, a
    rank over max_rank)."""
    folder = Path(folder).expanduser()
    if adapter_format(name, folder) == "gguf":
        config, tensors = read_gguf_adapter(folder, model_config)
    else:
        config, tensors = _read_config(folder), _read_tensors(folder)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None or match.group(3) not in _MODULES:
            raise ConfigError(f"LoRA adapter {name}: {key} is not a LoRA factor of an attention or MLP projection "
                              "(embedding and LM-head adapters are not supported)")
        layer = int(match.group(1))
        if layer >= model_config.num_hidden_layers:
            raise ConfigError(f"LoRA adapter {name}: {key} names layer {layer}; the model has "
                              f"{model_config.num_hidden_layers}")
        parts.setdefault((layer, match.group(3)), {})[match.group(4)] = tensor
    if not parts:
        raise ConfigError(f"LoRA adapter {name}: {folder} holds no LoRA factors")
    widths = projection_widths(model_config)
    scaled: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for (layer, module), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"LoRA adapter {name}: layer {layer} {module} lacks lora_{({'A', 'B'} - set(ab)).pop()}")
        A, B = ab["A"], ab["B"]
        rank = A.shape[0]
        if A.shape[1:] != (widths[module][0],) or B.shape != (widths[module][1], rank):
            raise ConfigError(f"LoRA adapter {name}: layer {layer} {module} A {tuple(A.shape)} / B {tuple(B.shape)} do "
                              f"not fit the model's {widths[module][1]} x {widths[module][0]} weight")
        if rank > max_rank:
            raise ConfigError(f"LoRA adapter {name}: rank {rank} is over max_lora_rank {max_rank} "
                              "(--max-lora-rank raises it)")
        hf_name = f"model.layers.{layer}.{'mlp' if _MODULES[module][0] >= 2 else 'self_attn'}.{module}"
        alpha = _pattern_value(config.get("alpha_pattern") or {}, hf_name, config.get("lora_alpha", 8))
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        scaled[(layer, module)] = (A.float(), B.float() * scale)
    deltas = {}
    for layer in sorted({layer for layer, _ in scaled}):
        for slot, (_, modules) in enumerate(FUSED_PARTS):
            present = [(i, m) for i, m in enumerate(modules) if (layer, m) in scaled]
            if present:
                deltas[(layer, slot)] = _fused_delta(present, modules, widths, [scaled[(layer, m)] for _, m in present],
                                                     dtype)
    rank = max(A.shape[0] for A, _ in scaled.values())
    log.info("LoRA adapter %s: %s, rank %d, %d modules", name, folder, rank, len(scaled))
    return LoraAdapter(name, folder, rank, deltas, next(_LOADS))


def projection_widths(config) -> dict[str, tuple[int, int]]:
    """(in, out) of each of a layer's seven projections, by HF module name (q_proj ... down_proj)."""
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    inter = config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _fused_delta(present: list[tuple[int, str]], modules: tuple[str, ...], widths: dict[str, tuple[int, int]],
                 factors: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> LoraDelta:
    """The parts' A stacked and their B placed block-diagonally at their output columns of the fused GEMM."""
    offsets = [0]
    for m in modules:
        offsets.append(offsets[-1] + widths[m][1])
    A = torch.cat([a for a, _ in factors])
    B = torch.zeros(offsets[-1], A.shape[0])
    col = 0
    for (i, _), (a, b) in zip(present, factors):
        B[offsets[i]:offsets[i + 1], col:col + a.shape[0]] = b
        col += a.shape[0]
    return LoraDelta(A.to(dtype).contiguous(), B.to(dtype).contiguous())


@dataclass(frozen=True)
class LoraRows:
    """One adapter's rows in a step: of every token (`rows`), and of the rows past the last layer's pruning
    (`out_rows`, the logits rows); None: all of them."""

    adapter: LoraAdapter
    rows: torch.Tensor | None
    out_rows: torch.Tensor | None


def lora_rows(adapters: dict[str, LoraAdapter], names: list[str | None], logits_index: list[int] | None,
              device: torch.device) -> list[LoraRows]:
    """The step's groups of rows by adapter, from each token's adapter name (None: the base model's)."""
    by_name: dict[str, list[int]] = {}
    for row, name in enumerate(names):
        if name is not None:
            by_name.setdefault(name, []).append(row)
    out_names = names if logits_index is None else [names[i] for i in logits_index]
    groups = []
    for name, rows in by_name.items():
        out = [i for i, n in enumerate(out_names) if n == name]
        as_rows = lambda xs, total: None if len(xs) == total else torch.tensor(xs, device=device)  # noqa: E731
        groups.append(LoraRows(adapters[name], as_rows(rows, len(names)), as_rows(out, len(out_names))))
    return groups


def with_lora(call: Callable[[torch.Tensor], torch.Tensor], updates: list[tuple[LoraDelta, torch.Tensor | None]]
              ) -> Callable[[torch.Tensor], torch.Tensor]:
    """A projection call that adds its adapters' updates to the base output (unchanged where none applies)."""
    if not updates:
        return call

    def project(x: torch.Tensor) -> torch.Tensor:
        y = call(x)
        for delta, rows in updates:
            delta.add_to(y, x, rows)
        return y

    return project
