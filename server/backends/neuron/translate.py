"""Our config -> transformers-neuronx arguments (a pure function: no SDK import, fully testable)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.config import Config, ConfigError
from server.models.source import check_max_model_len

_TRN1_MAX_TP = 32  # trn1.32xlarge: 16 chips x 2 NeuronCores


@dataclass(frozen=True)
class TnxArgs:
    """Everything `LlamaForSampling.from_pretrained` and `NeuronConfig` get, as plain data."""

    model_kwargs: dict[str, Any]
    neuron_config: dict[str, Any]
    continuous_batching: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    context_buckets: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()


def _buckets(name: str, values: list[int]) -> tuple[int, ...]:
    if not values:
        raise ConfigError(f"neuron.{name}: needs at least one bucket")
    if any(v < 1 for v in values) or list(values) != sorted(set(values)):
        raise ConfigError(f"neuron.{name}: buckets must be positive, unique and ascending, got {values}")
    return tuple(values)


def _check_model(cfg: Config, hf_config: dict[str, Any]) -> None:
    archs = hf_config.get("architectures") or []
    if archs and "LlamaForCausalLM" not in archs:  # tnx's LlamaForSampling is the graph our kernels patch
        raise ConfigError(f"model: the neuron backend compiles Llama models (transformers-neuronx's LlamaForSampling), "
                          f"not {archs[0]}; serve it with backend: torch")
    tp = cfg.neuron.tp_degree
    if tp & (tp - 1) or tp > _TRN1_MAX_TP:
        raise ConfigError(f"neuron.tp_degree: {tp} is not a power of two <= {_TRN1_MAX_TP} (trn1 NeuronCores)")
    heads = hf_config.get("num_attention_heads")
    if heads and heads % tp:
        raise ConfigError(f"neuron.tp_degree: {tp} does not divide the model's {heads} attention heads")
    check_max_model_len(hf_config, cfg.engine.max_model_len)


def translate(cfg: Config, hf_config: dict[str, Any]) -> TnxArgs:
    """Map `cfg` (neuron block + engine limits) onto transformers-neuronx 0.13 arguments, or raise ConfigError."""
    ncfg = cfg.neuron
    contexts = _buckets("context_buckets", ncfg.context_buckets)
    batches = _buckets("batch_buckets", ncfg.batch_buckets)
    _check_model(cfg, hf_config)
    if contexts[-1] < cfg.engine.max_model_len:
        raise ConfigError(f"neuron.context_buckets: largest bucket {contexts[-1]} is below engine.max_model_len "
                          f"{cfg.engine.max_model_len}; no compiled graph could hold the longest sequence")
    if cfg.engine.max_num_seqs > batches[-1]:
        raise ConfigError(f"engine.max_num_seqs: {cfg.engine.max_num_seqs} exceeds the largest neuron.batch_buckets "
                          f"entry {batches[-1]} (the compiled decode graph holds that many sequences)")
    if ncfg.use_lowrank_kernel and ncfg.amp != "bf16":
        raise ConfigError(f"neuron.amp: the low-rank NKI kernel is bf16 only, got {ncfg.amp!r}")
    # Positions never exceed max_model_len, so buckets above it would only cost compile time.
    positions = tuple(b for b in contexts if b < cfg.engine.max_model_len) + (cfg.engine.max_model_len,)
    model_kwargs = {
        "tp_degree": ncfg.tp_degree,
        "amp": ncfg.amp,
        "batch_size": batches[-1],
        "n_positions": list(positions),
        "context_length_estimate": list(positions),
    }
    # BSH keeps hidden states token-major ([seqs, tokens, hidden]), so reshaping to the kernel's
    # [num_tokens, hidden] is free; the fused private MLP/QKV kernels stay off so that our MLP path
    # (flat_compiler_layer -> gated_mlp) is the one that gets built. Sequence-parallel norm stays off:
    # above its threshold tnx's gated_mlp_bsh reduce-scatters along tokens (v0.13.0 hlo.py:730), which
    # the low-rank MLP graph does not mirror (tnx_patch.check_neuron_config refuses it with factors).
    neuron_config = {
        "attention_layout": "BSH",
        "fuse_mlp": False,
        "fused_rmsnorm_qkv": False,
        "fused_rmsnorm_mlp": False,
        "sequence_parallel_norm": False,
    }
    cache = str(Path(ncfg.compile_cache).expanduser())
    return TnxArgs(
        model_kwargs=model_kwargs,
        neuron_config=neuron_config,
        continuous_batching={"batch_size_for_shared_caches": batches[-1]},
        env={"NEURON_COMPILE_CACHE_URL": cache},
        context_buckets=positions,
        batch_buckets=batches,
    )


def build_tnx_config(args: TnxArgs, config_module: Any) -> Any:
    """The real `NeuronConfig` object from `transformers_neuronx.config` (passed in, so tests can fake it)."""
    batching = config_module.ContinuousBatchingConfig(**args.continuous_batching)
    return config_module.NeuronConfig(continuous_batching=batching, **args.neuron_config)
