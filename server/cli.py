"""`neuronmm` command line: serve | compress | eval | recover | bench."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import socket
import sys
import threading
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from server.config import ConfigError
from server.gc_heap import collections_held

# Subcommands that live in other packages register themselves through `register(subparsers)`.
log = logging.getLogger(__name__)

_PLUGIN_MODULES = ("compression.cli", "compression.evaluation.cli", "compression.recovery.cli", "bench.cli")


_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "float32": "float32", "float16": "float16",
           "half": "float16", "float": "float32"}  # vLLM's spellings
_KV_DTYPES = {**_DTYPES, "fp8": "fp8", "fp8_e4m3": "fp8_e4m3"}
# vLLM flags a copied command line brings that change nothing here, each with why: accepted, and named in a log line
_VLLM_NO_EFFECT = {
    "--trust-remote-code": (None, "the supported architectures are built in: no model code is downloaded or run"),
    "--gpu-memory-utilization": (float, "the KV block pool is sized by engine.kv_cache_gib"),
    "--swap-space": (float, "a preempted sequence is recomputed, not swapped"),
    "--enable-chunked-prefill": (None, "prompts are always taken in chunks (--max-num-batched-tokens)"),
    "--max-logprobs": (int, "logprobs go up to 20, as OpenAI's"),
    "--disable-log-requests": (None, "requests are not logged one by one"),
    "--enable-log-requests": (None, "requests are not logged one by one"),
    "--disable-log-stats": (None, "the engine logs no periodic stats: /metrics has them"),
}


def _env_true(name: str) -> bool:
    """An environment switch as vLLM reads its own (1 or true)."""
    return os.environ.get(name, "").strip().lower() in ("1", "true")


def _env_default(flag: str) -> str | None:
    """Every serve flag can also come from NEURONMM_<FLAG> (e.g. --max-model-len: NEURONMM_MAX_MODEL_LEN)."""
    return os.environ.get("NEURONMM_" + flag.lstrip("-").upper().replace("-", "_"))


def _prefill_cap(text: str) -> int | str:
    """--max-prefill-tokens-while-decoding: auto, off, or a count (the config checks its range)."""
    if text in ("auto", "off"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto, off or a number of tokens, got {text!r}") from None


def _lora_module(text: str) -> tuple[str, str]:
    """--lora-modules: name=path, or vLLM's JSON object with name and path."""
    if text.lstrip().startswith("{"):
        try:
            value = json.loads(text)
            return str(value["name"]), str(value["path"])
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f"expected {{\"name\": ..., \"path\": ...}}, got {text!r}") from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def _lora_table(modules: list[tuple[str, str]] | tuple[str, str] | None) -> dict[str, str] | None:
    """--lora-modules as the config's name -> path (NEURONMM_LORA_MODULES gives one name=path)."""
    if not modules:
        return None
    return dict([modules] if isinstance(modules, tuple) else modules)


def _speculative(text: str) -> dict:
    """--speculative-config: a JSON object (the config checks its fields)."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return value


def _origins(text: str) -> list[str]:
    """--allowed-origins: a JSON list (vLLM's form) or comma-separated origins."""
    if text.lstrip().startswith("["):
        try:
            origins = json.loads(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"not a JSON list: {exc}") from None
        if not isinstance(origins, list) or not all(isinstance(o, str) for o in origins):
            raise argparse.ArgumentTypeError("expected a JSON list of strings")
        return origins
    return [o.strip() for o in text.split(",") if o.strip()]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server",
                       description="Flags override the config; each also reads NEURONMM_<FLAG> from the environment.")

    def flag(name: str, **kwargs) -> None:
        env = _env_default(name)
        if kwargs.get("action") == "store_true":
            kwargs["default"] = env is not None and env.lower() in ("1", "true", "yes", "on")
        elif kwargs.get("action") is argparse.BooleanOptionalAction:  # unset: the config decides
            kwargs["default"] = None if env is None else env.lower() in ("1", "true", "yes", "on")
        else:
            kwargs["default"] = env
        p.add_argument(name, **kwargs)

    p.add_argument("model_or_config", nargs="?", metavar="MODEL|CONFIG",
                   help="a YAML config, or the model: a .gguf file, a folder with config.json, or a HF id")
    flag("--config", help="YAML config (default: configs/smollm2-135m.yaml)")
    flag("--host")
    flag("--port", type=int)
    flag("--api-key", help="require this bearer key")
    flag("--compressed", help="serve a compressed artifact directory on top of the model")
    flag("--served-model-name", nargs="+", help="the name(s) requests use; the first is reported back")
    flag("--max-model-len", type=int)
    flag("--max-num-seqs", type=int)
    flag("--max-num-batched-tokens", type=int)
    flag("--max-prefill-tokens-while-decoding", type=_prefill_cap, metavar="{auto,off,N}",
         help="the most prompt tokens a step takes beside running decodes (bounds how long a newcomer holds the "
              "streams); auto: 128 on a CPU unless the model runs in bf16 on AMX tiles, off elsewhere")
    flag("--dtype", choices=sorted(_DTYPES),
         help="auto: bf16 where the CPU has native bf16 dot products (or CUDA), else fp32; bfloat16 on a CPU "
              "without them keeps bf16 weights and computes in fp32")
    flag("--quantization", choices=["int8", "gguf", "none"],
         help="int8: int8 weights per output column, activations quantised per 64 inputs at run time (CPUs with "
              "AVX512-VNNI or AVX2); half the bytes of bf16 a decode step streams. gguf: the GGUF's own Q4_1 / Q8_0 "
              "blocks decoded in the fp32 GEMM, the fp32 weights exactly from a third of their bytes (unset: so "
              "wherever a GGUF's model runs in fp32 on a CPU). none: neither")
    flag("--kv-cache-dtype", choices=sorted(_KV_DTYPES),
         help="auto: the model's dtype; float16 or bfloat16 under a float32 model halve the cache; fp8 (e4m3) halves "
              "it again under float32 or bfloat16")
    flag("--enforce-eager", action="store_true",
         help="CUDA: run decode steps op by op instead of replaying captured CUDA graphs")
    flag("--tensor-parallel-size", type=int, help="NeuronCores to shard over (backend neuron)")
    flag("--chat-template", help="a Jinja file, or a bundled one: `hermes_tools` (ChatML with tool calls), "
                                 "`llama3_pythonic` (Llama 3 with pythonic tool calls)")
    flag("--tool-call-parser", help="how the model writes tool calls: hermes (default; Qwen's form), llama3_json, "
                                    "mistral or pythonic")
    flag("--reasoning-parser", help="deepseek_r1 or qwen3: a thinking model's <think>...</think> goes to `reasoning`")
    flag("--enable-auto-tool-choice", action="store_true",
         help="accepted as vLLM's command lines give it: `auto` tool calls are always parsed here")
    flag("--strict-fields", action="store_true", help="400 for unknown request fields (default: ignore, log)")
    flag("--stream-interval", type=int,
         help="tokens per streamed chunk after the first (default 1: each token as it comes)")
    flag("--num-threads", type=int)
    flag("--generation-config", help="sampling defaults for requests that set none: auto (the model's "
                                      "generation_config.json), vllm (the API's own), or a folder holding one")
    flag("--speculative-config", type=_speculative, metavar="JSON",
         help='n-gram speculative decoding as vLLM takes it: \'{"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\' (off by default)')
    flag("--seed", type=int, help="seeds the requests that bring no seed of their own")
    flag("--scheduling-policy", choices=["fcfs", "priority"],
         help="fcfs (default): arrival order; priority: each request's `priority` first (lower earlier), then arrival")
    flag("--enable-lora", action="store_true", help="serve LoRA adapters over the base model (--lora-modules)")
    flag("--lora-modules", type=_lora_module, nargs="+", metavar="NAME=PATH",
         help='PEFT LoRA folders or llama.cpp .gguf adapters, each served under its name (a request\'s `model`): '
              'name=path, or vLLM\'s JSON \'{"name": "sql", "path": "/adapters/sql"}\'')
    flag("--max-loras", type=int, help="distinct adapters in the running batch at once (default 1)")
    flag("--max-lora-rank", type=int, help="the largest adapter rank accepted (default 16)")
    flag("--block-size", type=int, help="KV cache positions per block")
    flag("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
         help="share cached prompt-prefix blocks between requests (default: on)")
    flag("--allowed-origins", type=_origins, metavar="ORIGINS",
         help='CORS origins, a JSON list as vLLM takes it (\'["*"]\') or comma-separated (default: none)')
    flag("--uvicorn-log-level", choices=["debug", "info", "warning", "error"], help="the server's log level")
    flag("--disable-uvicorn-access-log", action="store_true", help="no log line per HTTP request (as vLLM's)")
    flag("--shutdown-grace-s", type=float,
         help="on SIGTERM, how long in-flight requests may take before they are cut off")
    vllm = p.add_argument_group("accepted from vLLM command lines, no effect here")
    for name, (kind, why) in _VLLM_NO_EFFECT.items():
        extra = {"action": "store_true"} if kind is None else {"type": kind, "metavar": kind.__name__.upper()}
        vllm.add_argument(name, default=None, help=why, **extra)
    p.set_defaults(func=_run_serve)


def ignored_vllm_flags(args: argparse.Namespace) -> list[str]:
    """The no-effect vLLM flags a serve command line gave."""
    return [name for name in _VLLM_NO_EFFECT if getattr(args, name.lstrip("-").replace("-", "_")) not in (None, False)]


def _model_section(model: str, name: str) -> dict:
    """The config's model section for a MODEL argument, as vLLM reads it."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf":
        return {"name": name, "source": "gguf", "path": str(path)}
    if path.is_dir():
        return {"name": name, "source": "safetensors", "path": str(path)}
    if path.exists() or model.startswith((".", "/", "~")):
        raise ConfigError(f"MODEL {model}: not a .gguf file, a model folder or a Hugging Face id")
    return {"name": name, "source": "hf", "hf_id": model}


def _check_port_free(host: str, port: int) -> None:
    """Bind the port the way uvicorn will, before the model loads, so a clash is a one-line error."""
    if port == 0:
        return
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror} (--port / server.port)") from None


def serve_overrides(args: argparse.Namespace) -> tuple[str | None, dict]:
    """(config path, dotted overrides) from the serve flags; the MODEL argument replaces the model section."""
    config, model = args.config, None
    target = args.model_or_config
    if target and target.endswith((".yaml", ".yml")):
        config = config or target
    elif target:
        model = target
    names = args.served_model_name
    names = names.replace(",", " ").split() if isinstance(names, str) else (names or [])
    overrides: dict = {}
    if model:
        overrides["model"] = _model_section(model, names[0] if names else model)
    elif names:
        overrides["model.name"] = names[0]
    overrides.update({
        "server.model_aliases": names[1:] or None, "server.host": args.host, "server.port": args.port,
        "server.api_key": args.api_key, "model.compressed": args.compressed,
        "model.dtype": _DTYPES.get(args.dtype, args.dtype),  # an unknown one fails the config check
        "model.quantization": args.quantization,
        "engine.kv_cache_dtype": _KV_DTYPES.get(args.kv_cache_dtype, args.kv_cache_dtype),
        "engine.max_model_len": args.max_model_len, "engine.max_num_seqs": args.max_num_seqs,
        "engine.max_num_batched_tokens": args.max_num_batched_tokens,
        "engine.max_prefill_tokens_while_decoding": args.max_prefill_tokens_while_decoding,
        "neuron.tp_degree": args.tensor_parallel_size, "server.chat_template": args.chat_template,
        "server.tool_call_parser": args.tool_call_parser, "server.strict_fields": args.strict_fields or None,
        "server.reasoning_parser": args.reasoning_parser,
        "engine.num_threads": args.num_threads, "server.shutdown_grace_s": args.shutdown_grace_s,
        "server.stream_interval": args.stream_interval,
        "engine.enforce_eager": args.enforce_eager or None,
        "model.generation_config": args.generation_config, "engine.seed": args.seed,
        "engine.speculative": args.speculative_config, "engine.block_size": args.block_size,
        "engine.scheduling_policy": args.scheduling_policy,
        "engine.enable_lora": args.enable_lora or None, "engine.max_loras": args.max_loras,
        "engine.max_lora_rank": args.max_lora_rank,
        "engine.lora_modules": _lora_table(args.lora_modules),
        "engine.enable_prefix_caching": args.enable_prefix_caching, "server.cors_origins": args.allowed_origins,
        "server.log_level": args.uvicorn_log_level,
        "server.access_log": False if args.disable_uvicorn_access_log else None,
        "server.allow_runtime_lora_updating": _env_true("VLLM_ALLOW_RUNTIME_LORA_UPDATING") or None,
    })
    return config, overrides


def _run_serve(args: argparse.Namespace) -> int:
    # No cyclic collections through the imports and checks below, until the app freezes its start-up heap
    # (server.gc_heap); back on if the start stops early.
    with collections_held():
        return _serve(args)


def _serve(args: argparse.Namespace) -> int:
    from server.config import load_config
    from server.engine.engine_core import EngineCoreClient
    from server.models.source import check_max_model_len, resolve_model_dir

    cfg = load_config(*serve_overrides(args))
    _check_serve_inputs(cfg)
    _check_port_free(cfg.server.host, cfg.server.port)
    for name in ignored_vllm_flags(args):
        log.info("%s: accepted as vLLM takes it, no effect here (%s)", name, _VLLM_NO_EFFECT[name][1])
    core = None
    if cfg.server.engine_process and cfg.backend == "torch":
        # The engine core first, on the model converted here (once, on first use): its imports and load (seconds)
        # then run on the other CPU core while this process imports the server (seconds too). Not for Neuron: a
        # missing SDK must be the error it reports before anything else, and its compile takes minutes anyway.
        model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
        check_max_model_len(json.loads((model_dir / "config.json").read_text()), cfg.engine.max_model_len)
        core = EngineCoreClient(cfg)
        core.spawn()
    try:
        return _serve_with(cfg, core)
    except BaseException:
        if core is not None:
            core.stop()  # still loading: killed at once
        raise


def _check_serve_inputs(cfg) -> None:
    """The compressed artifact's manifest, the tool and reasoning parsers' names, the chat template, a generation
    config folder, the LoRA adapters' paths and the GEMM thresholds' variables (ConfigError, one line): modules
    without torch, read before the engine core spawns, so that a typo costs no model load."""
    from server.api.chat_templates import load_chat_template
    from server.api.generation_defaults import check_sampling_defaults, sampling_defaults
    from server.api.reasoning import get_reasoning_parser
    from server.api.tool_parsers import get_tool_parser
    from server.models.artifact import read_manifest
    from server.models.gemm_tuning import check_env as check_gemm_env
    from server.models.lora_paths import adapter_format

    # The core reads the artifact's factors. Not for Neuron, whose missing SDK must be the first error it reports
    # (its runner reads the artifact).
    if cfg.model.compressed and cfg.backend == "torch":
        read_manifest(cfg.model.compressed)
    try:
        get_tool_parser(cfg.server.tool_call_parser)
    except ValueError as exc:
        raise ConfigError(f"server.tool_call_parser: {exc}") from None
    try:
        get_reasoning_parser(cfg.server.reasoning_parser)
    except ValueError as exc:
        raise ConfigError(f"server.reasoning_parser: {exc}") from None
    load_chat_template(cfg.server.chat_template)
    if cfg.model.generation_config not in ("auto", "vllm"):  # auto: the model's own file, read once it is resolved
        check_sampling_defaults(sampling_defaults(Path(), cfg.model.generation_config))
    for name, path in cfg.engine.lora_modules.items():
        adapter_format(name, path)
    check_gemm_env()  # read again by the engine core when it packs the weights


def _serve_with(cfg, core) -> int:
    """The server, serving from `core` (None: the app spawns one)."""
    from server.api.app import serve

    return serve(cfg, core)


def _version() -> str:
    try:
        return version("neuronmm")
    except PackageNotFoundError:  # a checkout that was never installed
        return "0+unknown"


class OneLineErrors(argparse.ArgumentParser):
    """argparse that answers a bad flag with one line, as a bad config gets, not the full usage (serve's is ~30
    lines) above it. Subcommand parsers inherit it (add_subparsers makes them of the parent's class)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser(plugins: bool = True) -> argparse.ArgumentParser:
    """The CLI parser: serve, and (with `plugins`) the subcommands of the installed plugin modules."""
    parser = OneLineErrors(prog="neuronmm", description=__doc__)
    parser.add_argument("--version", action="version", version=f"neuronmm {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for name in _PLUGIN_MODULES if plugins else ():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not name.startswith(exc.name or "\0"):  # a real missing dependency, not the plugin
                raise
            continue
        module.register(sub)
    return parser


class _Terminated(Exception):
    """SIGTERM, raised in the main thread so that cleanup runs (a staged artifact, a temp folder): the signal's
    default action ends the process on the spot and leaves them behind."""


def _raise_terminated(_signum, _frame):
    raise _Terminated


def _terminate_with_cleanup(command: str):
    """Install _raise_terminated for an offline command (serve drains on SIGTERM itself); the handler it replaced."""
    if command == "serve" or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, _raise_terminated)


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 2 with one line for a bad config or input."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else argv
    try:
        # Every plugin's module is imported to build its subcommand (torch and the compression stack: a second or
        # more); `serve` needs none of them, and each second before it spawns the engine core delays the server.
        args = build_parser(plugins=argv[:1] != ["serve"]).parse_args(argv)
        previous = _terminate_with_cleanup(args.command)
        try:
            return int(args.func(args) or 0)
        except ConfigError as exc:
            print(f"neuronmm {args.command}: error: {exc}", file=sys.stderr)
            return 2
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    except KeyboardInterrupt:  # Ctrl+C before a command handles SIGINT itself (serve: while importing): one line
        print("neuronmm: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("neuronmm: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
