"""Typed deployment config: loaded from YAML, overridden from the CLI, errors that name the bad key."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from server.errors import ConfigError, first_error


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


_Section = TypeVar("_Section", bound=BaseModel)


class ModelConfig(_Strict):
    """Where the weights come from and how they are held in memory."""

    name: str = Field(description="model id the API serves (the `model` field of requests)")
    source: Literal["gguf", "safetensors", "hf"] = "gguf"
    # gguf: either `path`, or `package` + `resource` (a file inside an installed distribution)
    path: str | None = None
    package: str | None = None
    resource: str | None = None
    hf_id: str | None = None
    # auto: bf16 where the CPU has native bf16 dot products (or on CUDA), else fp32. bfloat16 on a CPU without
    # them: bf16 weights (half the bytes a step streams) in fp32 arithmetic, where bf16 math would be emulated
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # int8: every linear's weights in int8 per output column, activations quantised per 64 inputs at run time
    # (llama.cpp's q8_0 in spirit; CPUs with AVX512-VNNI or AVX2). Half the bytes of bf16 a step streams, at a cost
    # in quality docs/BENCHMARKS.md measures; a compressed artifact's factors are quantised too.
    # gguf (vLLM's name): the GGUF's own Q4_1 / Q8_0 blocks, decoded inside the fp32 GEMM: the fp32 model's weights bit
    # for bit from ~a third of the bytes (source gguf; fp32 activations; weights the file holds otherwise stay fp32).
    # Unset: gguf wherever the weights are fp32 on a CPU and the model comes from a GGUF with such blocks (the same
    # sums, so nothing to choose), else none; `none`: never.
    quantization: Literal["int8", "gguf", "none"] | None = Field(
        None, description="int8: int8 weights on the CPU panel GEMMs; gguf: the GGUF's own blocks, exactly; none")
    # A compressed artifact (manifest.json + factors) applied on top of the dense weights.
    compressed: str | None = None
    # vLLM's --generation-config: requests that leave temperature, top_p, top_k, min_p, repetition_penalty or
    # max_tokens unset get the model's generation_config.json values (auto), the API's own (vllm), or a folder's
    generation_config: str = Field("auto", description="sampling defaults: auto (the model's generation_config.json), "
                                                      "vllm (none), or a folder with a generation_config.json")

    @model_validator(mode="after")
    def _source_fields(self) -> "ModelConfig":
        if self.source == "gguf" and not self.path and not (self.package and self.resource):
            raise ValueError("source gguf needs `path`, or `package` and `resource`")
        if self.source == "safetensors" and not self.path:
            raise ValueError("source safetensors needs `path` (a folder with config.json)")
        if self.source == "hf" and not self.hf_id:
            raise ValueError("source hf needs `hf_id`")
        if self.quantization == "gguf" and self.source != "gguf":
            raise ValueError("quantization gguf runs a GGUF's own blocks: it needs source gguf")
        return self


class SpeculativeConfig(_Strict):
    """vLLM's --speculative-config, n-gram method: draft tokens looked up in the sequence's own text (prompt lookup
    decoding), checked by the model in one step; greedy replies as without it, sampled ones from the same
    distribution."""

    method: Literal["ngram"]
    num_speculative_tokens: int = Field(ge=1, le=16, description="draft tokens a step checks")
    prompt_lookup_max: int = Field(4, ge=1, description="the longest tail n-gram looked up")
    prompt_lookup_min: int = Field(2, ge=1, description="the shortest (a single token matches too often to pay)")
    # a batch's forward is compute-bound once it is large: drafts the model rejects then cost their rows' FLOPs
    disable_by_batch_size: int | None = Field(None, ge=1, description="no drafts while more sequences than this run")

    @model_validator(mode="after")
    def _window(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min must be <= prompt_lookup_max")
        return self


class EngineConfig(_Strict):
    """Continuous-batching limits (the names vLLM users know)."""

    max_num_seqs: int = Field(16, ge=1, le=1024)
    max_num_batched_tokens: int = Field(512, ge=16)
    # auto: runtime.CPU_PREFILL_CAP on a CPU (a prompt token costs ~0.5-1 ms there: a 512-token chunk held every
    # stream 0.3-0.5 s) unless the model runs in bf16 on AMX tiles (512 tokens in ~0.1 s, where a cap cost 1-7 % of
    # the throughput); off elsewhere. off (or null): a step's whole budget.
    max_prefill_tokens_while_decoding: int | Literal["auto", "off"] | None = Field(
        "auto", description="the most prompt tokens a step takes beside running decodes (auto, off, or a number); "
        "a smaller number bounds how long a newcomer's prompt holds every stream")
    max_model_len: int = Field(2048, ge=16)
    max_queue: int = Field(256, ge=1, description="waiting requests beyond this get 429")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads; default: all cores")
    seed: int = Field(0, description="seeds the per-request seeds of requests that bring none")
    block_size: int = Field(16, ge=1, le=1024, description="KV cache positions per block (paged backends)")
    kv_cache_gib: float | None = Field(None, gt=0, description="KV block pool size; default: max_num_seqs x max_model_len")
    # auto: the model's dtype. float16 / bfloat16 under a float32 model halve the bytes attention reads a step
    # and the pool's size per token (llama.cpp's default cache is f16 whatever the weights' precision); fp8
    # (e4m3, no scales: vLLM's `--kv-cache-dtype fp8`) halves them again under a float32 or bfloat16 model.
    kv_cache_dtype: Literal["auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3"] = "auto"
    enable_prefix_caching: bool = Field(True, description="share cached prompt-prefix blocks between requests")
    enforce_eager: bool = Field(False, description="CUDA: run every step op by op instead of replaying decode steps "
                                                   "from captured CUDA graphs (vLLM's --enforce-eager)")
    speculative: SpeculativeConfig | None = Field(None, description="n-gram speculative decoding (off by default)")
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: arrival order; priority: a request's `priority` first (lower runs earlier, "
                            "preempting running requests of a later priority when out of room), then arrival")

    @field_validator("max_prefill_tokens_while_decoding", mode="before")
    @classmethod
    def _cap_or_word(cls, cap: Any) -> Any:
        if cap is False:  # YAML reads a bare `off` as false
            return "off"
        ok = cap in (None, "auto", "off") or (isinstance(cap, int) and not isinstance(cap, bool) and cap >= 1)
        if not ok:
            raise ValueError(f"expected auto, off or a number of tokens >= 1, got {cap!r}")
        return cap

    # LoRA adapters over the base model (vLLM's --enable-lora, --lora-modules, --max-loras, --max-lora-rank)
    enable_lora: bool = Field(False, description="serve LoRA adapters (lora_modules) over the base model")
    lora_modules: dict[str, str] = Field(
        default_factory=dict, description="adapter name (a request's `model`) -> PEFT LoRA folder or GGUF adapter")
    max_loras: int = Field(1, ge=1, description="distinct adapters in the running batch at once")
    max_lora_rank: int = Field(16, ge=1, description="the largest adapter rank accepted")

    @model_validator(mode="after")
    def _lora_enabled(self) -> "EngineConfig":
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora), as vLLM does")
        return self

    @model_validator(mode="after")
    def _a_token_a_sequence(self) -> "EngineConfig":
        # a decode step holds one token of each running sequence (vLLM refuses the same)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens {self.max_num_batched_tokens} must be >= max_num_seqs "
                             f"{self.max_num_seqs}: a step holds a token of each running sequence "
                             "(--max-num-batched-tokens)")
        return self


class ServerConfig(_Strict):
    """HTTP front."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: str | None = None
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    body_timeout_s: float = Field(30.0, gt=0, description="a request body that stalls this long gets 408")
    cors_origins: list[str] = Field(default_factory=list)
    shutdown_grace_s: float = Field(30.0, ge=0)
    # The engine in its own process (as vLLM's engine core): HTTP work then never holds the engine's GIL.
    engine_process: bool = True
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    access_log: bool = Field(True, description="a log line per HTTP request (uvicorn's access log)")
    # vLLM's --stream-interval: the first token goes out at once, then a chunk per this many tokens (and the last)
    stream_interval: int = Field(1, ge=1, description="tokens per streamed chunk after the first: more mean fewer "
                                                      "writes and less API CPU a token, at a coarser stream")
    # OpenAI API behaviour
    model_aliases: list[str] = Field(default_factory=list, description="more names requests may use for model.name")
    chat_template: str | None = Field(None, description="a Jinja file replacing the tokenizer's chat template, "
                                                        "or a bundled one: `hermes_tools` (ChatML with tool calls), "
                                                        "`llama3_pythonic` (Llama 3, pythonic tool calls)")
    tool_call_parser: str = Field("hermes", description="how the model writes tool calls (server/api/tool_parsers)")
    reasoning_parser: str | None = Field(None, description="deepseek_r1 or qwen3: a thinking model's <think> part "
                                                           "goes to `reasoning` (server/api/reasoning.py)")
    strict_fields: bool = Field(False, description="400 for unknown request fields (default: ignored, logged)")
    responses_store_size: int = Field(1000, ge=0, description="finished Responses API responses kept in memory for "
                                                              "GET and previous_response_id (0: none)")
    metrics_require_api_key: bool = False
    # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING (read by `neuronmm serve` too): POST /v1/load_lora_adapter and
    # /v1/unload_lora_adapter change the served adapters (engine.enable_lora) while it runs
    allow_runtime_lora_updating: bool = False


class CompressionConfig(_Strict):
    """Defaults for `neuronmm compress` (the offline step)."""

    keep_ratio: float = Field(0.8, gt=0, le=1, allow_inf_nan=False)
    method: Literal["whitened", "plain", "prune"] = "whitened"  # prune: structured, MLP channels in blocks
    targets: Literal["mlp", "mlp+attn"] = "mlp"
    rank_multiple: int = Field(128, ge=1)
    calib_samples: int = Field(64, ge=1)
    calib_seqlen: int = Field(512, ge=16)
    calib_data: str = "../shared/data/c4/c4-validation-sample.jsonl"  # ../shared/data/ means data_dir()
    seed: int = 0
    allocation: Literal["uniform", "sensitivity"] = "sensitivity"
    latency_model: Literal["none", "trn1"] = "none"
    sensitivity: Literal["fisher", "normalised"] = "fisher"


# Distillation's default weight of the next-token loss beside the KL: on SmolLM2-135M pruned to keep 0.8 it lowered
# WikiText-2 / PTB / C4 perplexity by 3-6 % against the KL alone, at no cost per step (docs/BENCHMARKS.md, issue 18)
DISTILL_CE_WEIGHT = 0.5


class RecoveryConfig(_Strict):
    """Defaults for `neuronmm recover` (LoRA on the factors or the factors themselves); CLI flags map 1:1 onto these."""

    objective: Literal["next_token", "distill"] = "next_token"  # distill: KL(dense teacher || student) per token (+ CE)
    train: Literal["lora", "factors"] = "lora"  # factors: the LowRankLinear A, B themselves, no adapters
    steps: int = Field(200, ge=1)
    # distinct training windows; None: steps × batch_size, every step new text. Fewer are revisited epoch by epoch
    # (with distill, the teacher's states are cached: a revisited step skips the teacher)
    windows: int | None = Field(None, ge=1)
    lr: float | None = Field(None, gt=0, allow_inf_nan=False)  # None: learning_rate's default for `train`
    # with distill: weight of a second loss, the RMS-normalised hidden states after each of the student's own
    # layers against the teacher's (compression.recovery.distill.hidden_state_loss); 0 = logits only
    hidden_loss: float = Field(0.0, ge=0, allow_inf_nan=False)
    # with distill: weight of the next-token cross-entropy on the training text, added to the KL (0 = KL only);
    # None: cross_entropy_weight's default
    ce_weight: float | None = Field(None, ge=0, allow_inf_nan=False)
    seqlen: int = Field(256, ge=1)
    batch_size: int = Field(4, ge=1)
    adapter_rank: int = Field(8, ge=1)
    alpha: float = 16.0
    warmup_steps: int = Field(10, ge=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float = Field(1.0, gt=0)
    checkpoint_every: int = Field(25, ge=1)
    seed: int = 0
    num_threads: int = Field(2, ge=1)
    device: str = "auto"

    @model_validator(mode="after")
    def _extra_loss_terms_need_distill(self) -> RecoveryConfig:
        if self.hidden_loss and self.objective != "distill":
            raise ValueError("hidden_loss needs objective distill (the targets are the dense teacher's hidden states)")
        if self.ce_weight and self.objective != "distill":
            raise ValueError("ce_weight needs objective distill (next_token is the cross-entropy alone)")
        return self

    @property
    def cross_entropy_weight(self) -> float:
        """ce_weight, else DISTILL_CE_WEIGHT with distill and 0 with next_token (which is the cross-entropy alone)."""
        if self.ce_weight is not None:
            return self.ce_weight
        return DISTILL_CE_WEIGHT if self.objective == "distill" else 0.0

    @property
    def learning_rate(self) -> float:
        """lr, else 1e-3 for LoRA adapters and 1e-4 for whole factors (an adapter-sized step swamps their entries)."""
        if self.lr is not None:
            return self.lr
        return 1e-3 if self.train == "lora" else 1e-4

    def fingerprint(self) -> dict:
        """The fields a resumed run must share with the run that wrote the checkpoint (lr, ce_weight as used)."""
        return {**self.model_dump(exclude={"num_threads", "device", "checkpoint_every"}), "lr": self.learning_rate,
                "ce_weight": self.cross_entropy_weight}


class NeuronConfig(_Strict):
    """transformers-neuronx settings (used only with backend: neuron)."""

    tp_degree: int = Field(1, ge=1)
    context_buckets: list[int] = Field(default_factory=lambda: [128, 512, 2048])
    batch_buckets: list[int] = Field(default_factory=lambda: [1, 4, 8])
    amp: Literal["bf16", "f16", "f32"] = "bf16"
    compile_cache: str = "~/.cache/neuronmm/neuron-compile"
    use_lowrank_kernel: bool = True


class Config(_Strict):
    """One deployment: model, backend, engine limits, server, offline compression and recovery defaults."""

    model: ModelConfig
    backend: Literal["torch", "neuron"] = "torch"
    device: str = "cpu"
    cache_dir: str = "~/.cache/neuronmm"
    engine: EngineConfig = Field(default_factory=EngineConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)
    compression: CompressionConfig = Field(default_factory=CompressionConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    neuron: NeuronConfig = Field(default_factory=NeuronConfig)

    @model_validator(mode="after")
    def _adapter_names(self) -> "Config":
        clash = sorted(set(self.engine.lora_modules) & {self.model.name, *self.server.model_aliases})
        if clash:
            raise ValueError(f"engine.lora_modules: {clash[0]} is also the served model's name")
        return self

    @property
    def cache_path(self) -> Path:
        return Path(self.cache_dir).expanduser()


# Package data (a link to configs/smollm2-135m.yaml in a checkout, a copy in the wheel).
DEFAULT_CONFIG = Path(__file__).resolve().parent / "default_config.yaml"
_CHECKOUT = Path(__file__).resolve().parent.parent
_SHARED_DATA = "../shared/data/"


def data_dir() -> Path:
    """The shared data root (calibration, evaluation, recovery text): $NEURONMM_DATA_DIR, else ../shared/data."""
    env = os.environ.get("NEURONMM_DATA_DIR")
    return Path(env).expanduser() if env else (_CHECKOUT.parent / "shared" / "data").resolve()


def data_path(value: str | Path, what: str) -> Path:
    """A data file named by a config key or flag (`what`, for the error): `../shared/data/...` lies under
    data_dir(); another relative path is taken from the current folder where a file is there (a flag's), else
    from the checkout (a config file's); a missing file is a ConfigError."""
    text = str(value)
    if text.startswith(_SHARED_DATA):
        path = data_dir() / text[len(_SHARED_DATA):]
        if not path.is_file():
            raise ConfigError(f"{what} not found: {path} (set NEURONMM_DATA_DIR)")
        return path.resolve()
    path = Path(text).expanduser()
    candidates = [path] if path.is_absolute() else [Path.cwd() / path, _CHECKOUT / path]
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(f"{what} not found: {' or '.join(str(c) for c in dict.fromkeys(candidates))}")


def data_file(*parts: str, what: str = "evaluation data") -> Path:
    """A file under data_dir() by its parts (e.g. "c4", "c4-validation-sample.jsonl"); missing: ConfigError."""
    return data_path(data_dir().joinpath(*parts), what)


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {part} is not a section")
    node[parts[-1]] = value


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, but a key given twice in one mapping is an error (PyYAML keeps the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise ConfigError(f"key {key!r} appears twice in one section (lines {seen[key]} and "
                                  f"{key_node.start_mark.line + 1})")
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Read a YAML config and apply dotted-key overrides (e.g. {"server.port": 8001})."""
    path = Path(path) if path else DEFAULT_CONFIG
    if path.is_dir():
        raise ConfigError(f"config file {path}: is a folder")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader) or {}
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text (UTF-8) file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({exc.__class__.__name__})") from exc
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    given = {key: value for key, value in (overrides or {}).items() if value is not None}
    for key, value in given.items():
        _set_dotted(data, key, value)
    try:
        return Config.model_validate(data)
    except ValidationError as exc:  # named by where the bad value came from: the file, or an override (a flag)
        loc = ".".join(str(p) for p in exc.errors()[0]["loc"])
        overridden = any(loc == key or loc.startswith(key + ".") for key in given)
        raise ConfigError(f"{'the command line' if overridden else path}: {first_error(exc)}") from None


def validate_section(cls: type[_Section], data: dict[str, Any], where: str) -> _Section:
    """cls.model_validate(data) for any part of the config tree; a failure is a ConfigError `where: key ...`."""
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {first_error(exc)}") from None
