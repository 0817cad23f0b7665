"""Grammar engines for structured output, measured: llguidance (what the server uses) beside xgrammar.

For one JSON schema and one valid JSON answer (tokenized by the default model's tokenizer), each engine
compiles the schema, then for every token of the answer computes the next-token mask over the whole
vocabulary and accepts the token: what the batched sampler pays per sequence and step. Reports compile
time and the per-token mask time (p50 / p99), plus each engine's installed size with its own
dependencies (what a user downloads). xgrammar is optional: install it with `pip install xgrammar`
(it pulls triton and apache-tvm-ffi); where it is absent the report says so and measures llguidance alone.

    python -m bench.grammar_engines
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import re
import statistics
import time
from pathlib import Path

from bench.harness import check_out, machine_facts, run_cli, save_report
from server.config import load_config
from server.engine.structured import grammar_for, ll_tokenizer
from server.engine.sampling_params import StructuredOutput
from server.models.source import resolve_model_dir
from server.runtime import load_tokenizer

RESULTS = Path(__file__).parent / "results"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}}, "required": ["name", "age", "tags", "address"]}
SERVER_DEPS = {"torch", "transformers", "numpy", "pydantic", "typing-extensions", "typing_extensions"}  # the server has them
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["mathematician", "writer", "analyst"] * 4,
          "address": {"city": "London", "zip": "W1"}}


def installed_mib(dist: str) -> tuple[float, list[str]]:
    """Installed size of a distribution with the dependencies it adds to the server's, MiB; and the
    declared dependencies this machine lacks (their size is not counted)."""
    seen, missing, size = set(), [], 0

    def visit(name: str) -> None:
        nonlocal size
        try:
            d = md.distribution(name)
        except md.PackageNotFoundError:
            missing.append(name)
            return
        key = d.metadata["Name"].lower()
        if key in seen:
            return
        seen.add(key)
        size += sum((f.size or 0) for f in d.files or [])
        for req in d.requires or []:
            if "extra ==" in req or ('platform_system == "Darwin"' in req):
                continue
            dep = re.split(r"[\s;\[<>=!~]", req, maxsplit=1)[0]
            if dep.lower() not in SERVER_DEPS:
                visit(dep)

    visit(dist)
    return size / 2**20, missing


def time_llguidance(tokenizer, vocab: int, ids: list[int]) -> dict:
    """Compile + per-token mask times of llguidance, as server.engine.structured drives it."""
    import llguidance

    lltok = ll_tokenizer(tokenizer, vocab)
    grammar = grammar_for(StructuredOutput("json_schema", json.dumps(SCHEMA)))
    start = time.perf_counter()
    matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
    import torch

    bitmask = torch.empty((vocab + 31) // 32, dtype=torch.int32)
    matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)  # first mask: lazy compile ends here
    compile_s = time.perf_counter() - start
    times = []
    for tid in ids:
        t = time.perf_counter()
        matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.numel() * 4)
        times.append(time.perf_counter() - t)
        assert matcher.consume_tokens([tid]), "llguidance rejected the reference answer"
    return {"engine": "llguidance", "version": md.version("llguidance"), "compile_ms": 1e3 * compile_s,
            **_stats(times), **_footprint("llguidance")}


def time_xgrammar(tokenizer, vocab: int, ids: list[int]) -> dict | None:
    """The same with xgrammar; None when it is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    start = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    compile_s = time.perf_counter() - start
    times = []
    for tid in ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - t)
        assert matcher.accept_token(tid), "xgrammar rejected the reference answer"
    return {"engine": "xgrammar", "version": md.version("xgrammar"), "compile_ms": 1e3 * compile_s,
            **_stats(times), **_footprint("xgrammar")}


def _footprint(dist: str) -> dict:
    mib, missing = installed_mib(dist)
    return {"installed_mib": mib, "missing_dependencies": missing}


def _stats(times: list[float]) -> dict:
    ordered = sorted(times)
    return {"tokens": len(times), "mask_us_p50": 1e6 * statistics.median(times),
            "mask_us_p99": 1e6 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def main(argv: list[str] | None = None) -> int:
    """CLI entry: measure each installed engine, print a table, save JSON + markdown."""
    p = argparse.ArgumentParser(prog="bench.grammar_engines", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--out", default=str(RESULTS / "grammar_engines.json"))
    args = p.parse_args(argv)
    out = check_out(args.out)
    cfg = load_config(args.config)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    tokenizer = load_tokenizer(model_dir)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    ids = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    rows = [time_llguidance(tokenizer, vocab, ids)]
    xg = time_xgrammar(tokenizer, vocab, ids)
    note = "" if xg else "xgrammar is not installed (`pip install xgrammar`): llguidance measured alone."
    rows += [xg] if xg else []
    lines = ["| engine | version | compile ms | mask p50 / p99 µs | tokens | installed MiB (+ deps the server lacks) |",
             "|---|---|---:|---:|---:|---|"]
    lines += [f"| {r['engine']} | {r['version']} | {r['compile_ms']:.1f} | {r['mask_us_p50']:.0f} / {r['mask_us_p99']:.0f} | "
              f"{r['tokens']} | {r['installed_mib']:.0f}"
              + (f" (not installed here, not counted: {', '.join(r['missing_dependencies'])})" if r["missing_dependencies"] else "")
              + " |" for r in rows]
    if note:
        lines += ["", note]
    report = {**machine_facts(), "vocab_size": vocab, "schema": SCHEMA, "rows": rows, "note": note}
    save_report(out, report, "\n".join(lines))
    print("\n".join(lines))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
