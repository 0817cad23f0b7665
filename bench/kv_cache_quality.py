"""What a narrower KV cache or int8 weights cost in quality: WikiText-2 perplexity and greedy agreement through the
serving runner.

`engine.kv_cache_dtype: float16` (or bfloat16) under a float32 model, or fp8 (e4m3) under a float32 or bfloat16 one,
stores keys and values rounded and attention reads them widened; `model.quantization: int8` multiplies int8 weights
by activations quantised per 64 inputs (`--quantizations none int8`: every cache dtype with each). This scores the same evenly spaced WikiText-2 windows through `TorchRunner` (the fused
attention reads every position back from the cache, so the rounding reaches every score) once per cache dtype,
and decodes greedy continuations of prompts cut from other windows, counting where each leaves the
full-precision cache's tokens.

    python -m bench.kv_cache_quality --out bench/results/kv_cache_quality.json
    python -m bench.kv_cache_quality --dtype bfloat16 --kv-cache-dtypes auto --quantizations none int8
    python -m bench.cpu_caps avx2 python -m bench.kv_cache_quality    # the AVX2 build's kernels
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from bench.harness import (KV_CACHE_DTYPES, MODEL_DTYPES, check_out, int_at_least, machine_facts, positive_int, publish,
                           run_cli)
from bench.position_nll import spread_windows
from compression.evaluation.corpora import corpus_text
from compression.evaluation.perplexity import token_windows
from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.config import load_config
from server.models.source import gguf_path, resolve_model_dir
from server.runtime import load_tokenizer

RESULTS = Path(__file__).parent / "results"


def window_nll(runner: TorchRunner, windows: torch.Tensor, desc: str) -> float:
    """Mean NLL (float64) of each window's tokens 1..L-1, each window one prefill into a fresh cache."""
    table = list(range(runner.cache.num_blocks))
    total, count = 0.0, 0
    for window in tqdm(windows, desc=desc, unit="window"):
        logits = runner.execute([SeqChunk(-1, window.tolist(), 0, block_table=table, all_logits=True)])
        total += float(F.cross_entropy(logits[:-1].float(), window[1:], reduction="sum").double())
        count += len(window) - 1
    return total / count


def greedy(runner: TorchRunner, prompt: list[int], tokens: int) -> list[int]:
    """`tokens` greedy tokens after `prompt`, one decode step at a time."""
    table = list(range(runner.cache.num_blocks))
    out = [int(runner.execute([SeqChunk(-1, prompt, 0, block_table=table)])[-1].argmax())]
    for i in range(tokens - 1):
        out.append(int(runner.execute([SeqChunk(-1, out[-1:], len(prompt) + i, block_table=table)])[-1].argmax()))
    return out


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """How far the continuations stay on the reference's tokens: the share identical throughout, the mean first
    differing position (the length where none differs)."""
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), len(r)) for r, o in zip(reference, other)]
    return {"identical": sum(f == len(r) for f, r in zip(firsts, reference)) / len(reference),
            "mean_first_difference": sum(firsts) / len(firsts), "first_differences": firsts}


def markdown(report: dict) -> str:
    lines = [f"CPU flags {' '.join(report['cpu_flags'])}; caps {report['caps_in_force'] or 'none'}; model "
             f"{report['dtype']}", "",
             "| KV cache | weights | WikiText-2 ppl | × the first row | greedy identical | mean first difference |",
             "|---|---|---:|---:|---:|---:|"]
    for r in report["rows"]:
        lines.append(f"| {r['kv_cache_dtype']} | {r['quantization'] or report['dtype']} | {r['ppl']:.4f} | "
                     f"{r['ppl_ratio']:.5f} | {r['identical']:.0%} | "
                     f"{r['mean_first_difference']:.1f} of {report['greedy_tokens']} |")
    lines += ["", f"{report['windows']} windows of {report['seqlen']} tokens (of {report['windows_total']}); "
                  f"{report['greedy_prompts']} prompts of {report['prompt_len']} tokens, {report['greedy_tokens']} "
                  "greedy tokens each"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: score each cache dtype, print a table, save JSON and markdown."""
    p = argparse.ArgumentParser(prog="bench.kv_cache_quality", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default="float32", help="the model's dtype")
    p.add_argument("--kv-cache-dtypes", nargs="+", choices=KV_CACHE_DTYPES, default=["auto", "float16", "bfloat16"],
                   help="the first is the reference (auto: the model's dtype)")
    p.add_argument("--quantizations", nargs="+", choices=["none", "int8", "gguf"], default=["none"],
                   help="weights for each cache dtype: the model's (none) and / or int8")
    p.add_argument("--seqlen", type=int_at_least(2), default=512)  # a window scores its tokens after the first
    p.add_argument("--windows", type=positive_int, default=16, help="evenly spaced windows of the WikiText-2 test set")
    p.add_argument("--greedy-prompts", type=positive_int, default=16)
    p.add_argument("--prompt-len", type=positive_int, default=64)
    p.add_argument("--greedy-tokens", type=positive_int, default=64)
    p.add_argument("--out", default=str(RESULTS / "kv_cache_quality.json"))
    args = p.parse_args(argv)
    out = check_out(args.out)
    cfg = load_config(args.config)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    ids = torch.tensor(load_tokenizer(model_dir)(corpus_text("wikitext2"), verbose=False)["input_ids"])
    all_windows = token_windows(ids, args.seqlen)
    windows = spread_windows(all_windows, args.windows)
    # prompts from the windows the perplexity does not score, so the two measures see different text
    prompts = [w[:args.prompt_len].tolist() for w in spread_windows(all_windows.flip(0), args.greedy_prompts)]
    max_len = max(args.seqlen, args.prompt_len + args.greedy_tokens)
    rows, reference = [], None
    for kv, quantization in ((kv, q) for kv in args.kv_cache_dtypes for q in args.quantizations):
        quantization = None if quantization == "none" else quantization
        runner = TorchRunner(model_dir, max_len, args.dtype, cfg.device, kv_cache_dtype=kv, quantization=quantization,
                             gguf_source=gguf_path(cfg.model) if quantization == "gguf" else None)
        runner.load()
        runner.allocate_kv_blocks(-(-max_len // cfg.engine.block_size), cfg.engine.block_size)
        nll = window_nll(runner, windows, f"ppl, {kv} cache, {quantization or args.dtype} weights")
        continuations = [greedy(runner, prompt, args.greedy_tokens) for prompt in tqdm(prompts, desc="greedy")]
        reference = reference or (nll, continuations)
        rows.append({"kv_cache_dtype": str(runner.cache_dtype).removeprefix("torch."), "quantization": quantization,
                     "ppl": math.exp(nll),
                     "ppl_ratio": math.exp(nll - reference[0]), **agreement(reference[1], continuations)})
        del runner
    report = {**machine_facts(), "config": args.config,
              "dtype": args.dtype, "seqlen": args.seqlen, "windows": len(windows), "windows_total": len(all_windows),
              "greedy_prompts": len(prompts), "prompt_len": args.prompt_len, "greedy_tokens": args.greedy_tokens,
              "rows": rows}
    return publish(out, report, markdown(report))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
