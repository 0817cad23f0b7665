"""Typed deployment config: loaded from YAML, overridden from the CLI, errors that name the bad key."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from server.errors import ConfigError, first_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class ModelConfig(_Strict):
    """Where the weights come from and how they are held in memory."""

    name: str = Field(description="model id the API serves (the `model` field of requests)")
    source: Literal["gguf", "safetensors", "hf"] = "gguf"
    # gguf: either `path`, or `package` + `resource` (a file inside an installed distribution)
    path: str | None = None
    package: str | None = None
    resource: str | None = None
    hf_id: str | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    # A compressed artifact (manifest.json + factors) applied on top of the dense weights.
    compressed: str | None = None

    @model_validator(mode="after")
    def _source_fields(self) -> "ModelConfig":
        if self.source == "gguf" and not self.path and not (self.package and self.resource):
            raise ValueError("source gguf needs `path`, or `package` and `resource`")
        if self.source == "safetensors" and not self.path:
            raise ValueError("source safetensors needs `path` (a folder with config.json)")
        if self.source == "hf" and not self.hf_id:
            raise ValueError("source hf needs `hf_id`")
        return self


class EngineConfig(_Strict):
    """Continuous-batching limits (the names vLLM users know)."""

    max_num_seqs: int = Field(16, ge=1, le=1024)
    max_num_batched_tokens: int = Field(512, ge=16)
    max_model_len: int = Field(2048, ge=16)
    max_queue: int = Field(256, ge=0, description="waiting requests beyond this get 429")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: all cores")
    seed: int = 0


class ServerConfig(_Strict):
    """HTTP front."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0, description="a request body that stalls this long gets 408")
    cors_origins: list[str] = Field(default_factory=list)
    shutdown_grace_s: float = Field(30.0, ge=0)
    log_level: Literal["debug", "info", "warning", "error"] = "info"


class CompressionConfig(_Strict):
    """Defaults for `neuronmm compress` (the offline step)."""

    keep_ratio: float = Field(0.8, gt=0, le=1)
    method: Literal["whitened", "plain"] = "whitened"
    targets: Literal["mlp", "mlp+attn"] = "mlp"
    rank_multiple: int = Field(128, ge=1)
    calib_samples: int = Field(64, ge=1)
    calib_seqlen: int = Field(512, ge=16)
    calib_data: str = "../shared/data/c4/c4-validation-sample.jsonl"
    seed: int = 0
    allocation: Literal["uniform", "sensitivity"] = "sensitivity"
    latency_model: Literal["none", "trn1"] = "none"
    sensitivity: Literal["fisher", "normalised"] = "fisher"


class NeuronConfig(_Strict):
    """transformers-neuronx settings (used only with backend: neuron)."""

    tp_degree: int = Field(1, ge=1)
    context_buckets: list[int] = Field(default_factory=lambda: [128, 512, 2048])
    batch_buckets: list[int] = Field(default_factory=lambda: [1, 4, 8])
    amp: Literal["bf16", "f16", "f32"] = "bf16"
    compile_cache: str = "~/.cache/neuronmm/neuron-compile"
    use_lowrank_kernel: bool = True


class Config(_Strict):
    """One deployment: model, backend, engine limits, server, offline compression defaults."""

    model: ModelConfig
    backend: Literal["torch", "neuron"] = "torch"
    device: str = "cpu"
    cache_dir: str = "~/.cache/neuronmm"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    neuron: NeuronConfig = Field(default_factory=NeuronConfig)

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "smollm2-135m.yaml"


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a YAML config and apply dotted-key overrides (e.g. {"server.port": 8001})."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for key, value in (overrides or {}).items():
        if value is not None:
            _set_dotted(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{path}: {first_error(exc)}") from None
