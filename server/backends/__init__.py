"""Model runners behind one protocol (see base.py); `create_runner` picks one from the config."""

from __future__ import annotations

from pathlib import Path

import torch

from server.backends.neuron import create_neuron_runner, require_neuron_sdk
from server.backends.torch_runner import (TorchRunner, check_quantization, resolve_kv_cache_dtype,
                                         resolve_weight_dtype)
from server.config import Config, ConfigError, ModelConfig
from server.models.source import gguf_path


def gguf_source(model: ModelConfig) -> Path | None:
    """The GGUF whose blocks `quantization: gguf` (or, unset, an fp32 CPU model) runs: None under int8 or `none`, or
    for a model from another source."""
    return gguf_path(model) if model.source == "gguf" and model.quantization in (None, "gguf") else None


def create_runner(cfg: Config, model_dir: Path):
    """The configured backend's runner, not yet loaded."""
    compressed = Path(cfg.model.compressed).expanduser() if cfg.model.compressed else None
    if cfg.backend == "torch":
        if cfg.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise ConfigError(f"device: {cfg.device!r} requested but torch sees no CUDA device")
        return TorchRunner(model_dir, cfg.engine.max_model_len, cfg.model.dtype, cfg.device, compressed,
                           cfg.engine.num_threads, kv_cache_dtype=cfg.engine.kv_cache_dtype,
                           cuda_graphs=not cfg.engine.enforce_eager, max_num_seqs=cfg.engine.max_num_seqs,
                           lora_modules={name: Path(path) for name, path in cfg.engine.lora_modules.items()},
                           max_lora_rank=cfg.engine.max_lora_rank, quantization=cfg.model.quantization,
                           gguf_source=gguf_source(cfg.model))
    if cfg.backend == "neuron":
        return create_neuron_runner(cfg, model_dir, compressed)
    raise ConfigError(f"backend: unknown backend {cfg.backend!r}")


def check_backend_available(cfg: Config) -> None:
    """Fail fast (ConfigError, one line) when the configured backend cannot run on this machine."""
    if cfg.backend == "neuron":
        if cfg.engine.kv_cache_dtype != "auto":
            raise ConfigError("engine.kv_cache_dtype: the neuron backend keeps its cache in the model's dtype (auto)")
        if cfg.engine.lora_modules:
            raise ConfigError("engine.lora_modules: the neuron backend serves no LoRA adapters (the torch one does)")
        if cfg.model.quantization not in (None, "none"):
            raise ConfigError("model.quantization: the neuron backend serves the model's own dtype")
        require_neuron_sdk()
        return
    if cfg.device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError(f"device: {cfg.device!r} requested but torch sees no CUDA device")
    device = torch.device(cfg.device)
    check_quantization(cfg.model.quantization, device, gguf_source(cfg.model))
    model_dtype = resolve_weight_dtype(cfg.model.dtype, device, cfg.model.quantization, log_choice=False)
    resolve_kv_cache_dtype(cfg.engine.kv_cache_dtype, model_dtype)
