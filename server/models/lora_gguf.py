"""LoRA adapters in llama.cpp's GGUF format (what convert_lora_to_gguf.py writes and llama-server's --lora loads),
read back into the PEFT factors and adapter config they were converted from.

A GGUF adapter holds, per projection, `blk.<layer>.<tensor>.weight.lora_a` [rank, in] and `.lora_b` [out, rank]
under llama.cpp's tensor names, and its alpha as `adapter.lora.alpha` (the scale is alpha / rank, as llama.cpp
applies it; an adapter written without an alpha has scale 1). For the llama architecture the converter permutes
the rows of q and k (and so the rows of their B) into llama.cpp's rotary layout, as it does the base weights; they
are permuted back here, so the factors fit the model's Hugging Face layout whatever its weights were read from.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch
from gguf import GGUFReader, Keys
from gguf.quants import dequantize

from server.errors import ConfigError

# llama.cpp's name of each projection an adapter may touch, as (block, Hugging Face module)
_PROJECTIONS = {"attn_q": ("self_attn", "q_proj"), "attn_k": ("self_attn", "k_proj"), "attn_v": ("self_attn", "v_proj"),
                "attn_output": ("self_attn", "o_proj"), "ffn_gate": ("mlp", "gate_proj"), "ffn_up": ("mlp", "up_proj"),
                "ffn_down": ("mlp", "down_proj")}
_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.weight\.lora_([ab])$")
# the llama.cpp architecture a served model type converts to (Mistral's converter is Llama's)
_ARCHITECTURE = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_PERMUTED = {"llama"}  # architectures whose q and k rows the converter permutes


def _scalar(reader: GGUFReader, key: str):
    """A metadata field's value (a str, a number), or None where the file lacks it."""
    field = reader.fields.get(key)
    if field is None or not field.data:
        return None
    value = field.parts[field.data[0]]
    return bytes(value).decode() if field.types and field.types[0].name == "STRING" else value[0].item()


def _unpermute(rows: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary permutation of a q or k weight's rows (each head's halves interleaved back)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


def read_gguf_adapter(path: Path, model_config) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config, tensors) as a PEFT LoRA folder holds them, from a GGUF LoRA adapter for the model; a
    ConfigError says what the file is instead (a model, another adapter type, another architecture, a tensor of
    something but the seven projections)."""
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # noqa: BLE001 - numpy's and gguf's parse errors share no base class
        raise ConfigError(f"LoRA adapter {path}: not a readable GGUF file ({exc.__class__.__name__})") from None
    if _scalar(reader, Keys.General.TYPE) != "adapter" or _scalar(reader, Keys.Adapter.TYPE) != "lora":
        kind, adapter = _scalar(reader, Keys.General.TYPE), _scalar(reader, Keys.Adapter.TYPE)
        raise ConfigError(f"LoRA adapter {path}: a GGUF file but not a LoRA adapter (general.type {kind!r}, "
                          f"adapter.type {adapter!r})")
    if Keys.Adapter.ALORA_INVOCATION_TOKENS in reader.fields:
        raise ConfigError(f"LoRA adapter {path}: an activated LoRA (invocation tokens) is not supported")
    arch = _scalar(reader, Keys.General.ARCHITECTURE)
    wanted = _ARCHITECTURE.get(model_config.model_type)
    if wanted is not None and arch != wanted:
        raise ConfigError(f"LoRA adapter {path}: converted for llama.cpp architecture {arch!r}; the served "
                          f"{model_config.model_type} model's is {wanted!r}")
    heads = {"q_proj": model_config.num_attention_heads,
             "k_proj": getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads}
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        match = _NAME.match(tensor.name)
        if match is None or match.group(2) not in _PROJECTIONS:
            raise ConfigError(f"LoRA adapter {path}: {tensor.name} is not a LoRA factor of an attention or MLP "
                              "projection (token-embedding, output and norm tensors are not supported)")
        layer, (block, module), factor = int(match.group(1)), _PROJECTIONS[match.group(2)], match.group(3)
        shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        values = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a copy of the mapped file
        values = torch.from_numpy(values).reshape(shape)
        if factor == "b" and arch in _PERMUTED and module in heads:
            values = _unpermute(values, heads[module])
        tensors[f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{factor.upper()}.weight"] = values
    alpha = float(_scalar(reader, Keys.Adapter.LORA_ALPHA) or 0)
    config = {"peft_type": "LORA", "lora_alpha": alpha}
    if alpha == 0:  # llama.cpp applies such an adapter at scale 1: alpha = each module's rank
        config["alpha_pattern"] = {re.escape(key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")):
                                   values.shape[0] for key, values in tensors.items() if key.endswith("lora_A.weight")}
    return config, tensors
