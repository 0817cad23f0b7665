"""Build the serving model from a local HF folder: config, safetensors weights, optional low-rank artifact."""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoConfig

from server.config import ConfigError
from server.models.compressed import apply_compressed_artifact
from server.models.llama import LlamaModel
from server.models.module_init import no_init
from server.models.source import check_max_model_len

log = logging.getLogger(__name__)

# The Llama family as LlamaModel runs it: Mistral is Llama's layout; Qwen2 adds q/k/v biases, Qwen3 per-head q/k norms.
SUPPORTED_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                   "SmolLM3ForCausalLM"}


def load_state_dict(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in a folder."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"model.path: no .safetensors files in {model_dir}")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(file))
    return state


def check_sliding_window(config, max_len: int) -> None:
    """A model whose attention slides over a window runs here with full attention, which is the same only while
    every sequence fits in the window: max_model_len must not exceed it."""
    windowed = config.model_type == "mistral" or getattr(config, "use_sliding_window", False)
    window = getattr(config, "sliding_window", None) if windowed else None
    if window is not None and max_len > window:
        raise ConfigError(f"model: {config.model_type} attends over a sliding window of {window} tokens, which this "
                          f"server does not implement; serve it with --max-model-len {window} or less (within the "
                          "window attention is full, so the outputs are the model's)")


def load_llama(model_dir: Path, max_len: int, dtype: torch.dtype = torch.float32,
               compressed: Path | None = None) -> LlamaModel:
    """A ready-to-serve LlamaModel (weights loaded, low-rank factors applied, projections fused)."""
    config = AutoConfig.from_pretrained(model_dir)
    archs = set(getattr(config, "architectures", None) or [])
    if not archs & SUPPORTED_ARCHS:
        raise ConfigError(f"model: architecture {sorted(archs)} not supported (need one of {sorted(SUPPORTED_ARCHS)})")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ConfigError("model: Llama variants with biases are not supported")
    check_max_model_len(config.to_dict(), max_len)
    check_sliding_window(config, max_len)
    if getattr(config, "head_dim", None) is None:  # Qwen2's config leaves it implied
        config.head_dim = config.hidden_size // config.num_attention_heads
    with no_init():
        model = LlamaModel(config, max_len)
    state = {k.removeprefix("model."): v for k, v in load_state_dict(model_dir).items()}
    if "lm_head.weight" not in state:
        if not config.tie_word_embeddings:
            raise ConfigError(f"model: {model_dir} has no lm_head.weight and embeddings are not tied")
        state["lm_head.weight"] = state["embed_tokens.weight"]
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise ConfigError(f"model: weights do not match the config (missing {missing[:3]}, unexpected {unexpected[:3]})")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if compressed is not None:
        apply_compressed_artifact(model, compressed, model_dir)
    model.fuse_projections()
    model.to(dtype)
    model.eval()
    log.info("loaded %s: %d layers, hidden %d, %.1fM parameters", model_dir.name, config.num_hidden_layers,
             config.hidden_size, sum(p.numel() for p in model.parameters()) / 1e6)
    return model
