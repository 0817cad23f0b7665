"""`neuronmm` command line: serve | compress | eval | bench."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from server.config import ConfigError

# Subcommands that live in other packages register themselves through `register(subparsers)`.
_PLUGIN_MODULES = ("compression.cli", "compression.evaluation.cli", "compression.recovery.cli", "bench.cli")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the OpenAI-compatible server")
    p.add_argument("--config", help="YAML config (default: configs/smollm2-135m.yaml)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require this bearer key (or set NEURONMM_API_KEY)")
    p.add_argument("--compressed", help="serve a compressed artifact directory on top of the model")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--shutdown-grace-s", type=float,
                   help="on SIGTERM, how long in-flight requests may take before they are cut off")
    p.set_defaults(func=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    import os

    from server.api.app import serve
    from server.config import load_config

    cfg = load_config(args.config, {
        "server.host": args.host, "server.port": args.port,
        "server.api_key": args.api_key or os.environ.get("NEURONMM_API_KEY"),
        "model.compressed": args.compressed, "engine.max_num_seqs": args.max_num_seqs,
        "engine.num_threads": args.num_threads, "server.shutdown_grace_s": args.shutdown_grace_s,
    })
    return serve(cfg)


def build_parser() -> argparse.ArgumentParser:
    """The full CLI parser, including subcommands from installed plugin modules."""
    parser = argparse.ArgumentParser(prog="neuronmm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    for name in _PLUGIN_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not name.startswith(exc.name or "\0"):  # a real missing dependency, not the plugin
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; exit code 2 with one line for a bad config or input."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ConfigError as exc:
        print(f"neuronmm {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
