"""`neuronmm bench NAME [args]`: run the benchmark script bench/NAME.py (serve, kernels, load, ...)."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from pathlib import Path

from server import cli as server_cli
from server.errors import ConfigError


def _available() -> list[str]:
    """The benchmark scripts: bench's modules with a main() (the others, harness and the like, are their parts)."""
    here = Path(__file__).parent
    return sorted(m.name for m in pkgutil.iter_modules([str(here)])
                  if m.name != "cli" and "\ndef main(" in (here / f"{m.name}.py").read_text(encoding="utf-8"))


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    p = sub.add_parser("bench", help="run a benchmark script (results go to bench/results)")
    p.add_argument("name", help=f"one of: {', '.join(_available())}")
    p.add_argument("args", nargs=argparse.REMAINDER, help="passed to the script (see its --help)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.name not in _available():
        raise ConfigError(f"unknown benchmark {args.name!r} (available: {', '.join(_available())})")
    module = importlib.import_module(f"bench.{args.name}")
    return int(module.main(args.args) or 0)


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.cli NAME [args]`: the same as `neuronmm bench NAME [args]` (its errors and exit codes too)."""
    return server_cli.main(["bench", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
