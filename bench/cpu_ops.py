"""The fused CPU ops one at a time: panel GEMMs by row count, a step's linears, batch-16 attention, the sampler ops.

What a decode step is made of, timed alone so a kernel change is seen without the rest of the step's noise.
Run it under `bench.cpu_caps` to time the code another CPU class runs:

    python -m bench.cpu_ops                                   # this CPU's build
    python -m bench.cpu_caps avx2 python -m bench.cpu_ops     # the AVX2 build, every library capped

Panel GEMMs: the SmolLM2 MLP's 1536 x 576 and 576 x 1536 in the dtype this build serves (bf16 where it has
AVX512-BF16, else fp32), best of `--repeats` runs of many calls, cache-warm. A step's linears: every projection of
the default model's `--step-layers` layers and its LM head, called in a decode step's order at each of
`--step-rows`, so every weight comes from DRAM as in a step (the weights' bytes over the time, next to the
measured bandwidth, say how close the GEMMs stream; at 16 fp32 rows the FMAs take as long as the bytes). With
`--gguf-blocks`, the same over GGUF block panels (`quantization: gguf`) beside fp32 panels of the same weights, and
each of the panel GEMMs above at each of `--rows` over both, on one thread and on all (cache-warm: what the tiles
and the threads cost apart from the stream).
Attention: 16 sequences of `--positions` cached positions, 30 layers' caches in turn (so each call reads from
memory, as a step's layers do): an fp32 model over an fp32 cache and over an fp16 one
(`engine.kv_cache_dtype: float16`), a bf16 model over its bf16 cache and over an fp8 one (`fp8`); then the same with uneven contexts (half the sequences at an eighth of `--positions`, half at the rest of twice it).
Prefill attention: an fp32 model's prompt chunk of TOKENS after PREFIX cached positions (`--prefill-chunks
PREFIX:TOKENS ...`), 30 layers' caches in turn, over an fp32 and an fp16 cache; its GFLOP/s count the causal
products (4 x head_dim x heads x the positions each token sees).
Sampler: 16 rows of a 49,152-token vocabulary.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.harness import check_out, machine_facts, positive_int, publish, run_cli
from server.models import fused_ops
from server.models.gguf_blocks import decode_blocks, pack_block_panels
from server.models.hugepages import into_huge_pages
from server.models.packed_linear import panels_available

RESULTS = Path(__file__).parent / "results"
GEMMS = ((1536, 576), (576, 1536))
HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS, SEQS, VOCAB, HIDDEN = 9, 3, 64, 16, 30, 16, 49152, 576
STEP_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # a layer's qkv, o, gate/up, down: (N, K)
ATTENTION_DTYPES = ((torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16),
                    (torch.bfloat16, torch.float8_e4m3fn))


def best_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """µs a call: the best of `repeats` timings of `calls` calls, after a warm-up."""
    for _ in range(max(1, calls // 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def panel_ops() -> tuple[torch.dtype, Callable, Callable]:
    """The dtype this build's panels serve (bf16 where it has AVX512-BF16, else fp32) and its pack and GEMM ops."""
    ops = torch.ops.neuronmm
    if panels_available(torch.device("cpu"), torch.bfloat16):
        return torch.bfloat16, ops.pack_panels, ops.panel_linear
    return torch.float32, ops.pack_panels_f32, ops.panel_linear_f32


def gemm_rows(rows_list: list[int], repeats: int) -> list[dict]:
    """µs and GFLOP/s of the panel GEMM per shape and row count, in the dtype this build's panels serve."""
    dtype, pack, gemm = panel_ops()
    gen = torch.Generator().manual_seed(0)
    out = []
    for n, k in GEMMS:
        panels = pack(torch.randn(n, k, generator=gen).to(dtype))
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen).to(dtype)
            us = best_us(lambda: gemm(x, panels, n), max(20, 20000 // rows), repeats)
            out.append({"dtype": str(dtype).removeprefix("torch."), "n": n, "k": k, "rows": rows, "us": us,
                        "gflops": 2 * rows * n * k / us / 1e3})
    return out


def step_linears(rows_list: list[int], repeats: int, layers: int = LAYERS) -> list[dict]:
    """ms, GB/s and GFLOP/s of one decode step's linears (`layers` layers' qkv, o, gate/up and down, then the LM
    head) at each row count, called in the step's order over weights in huge pages, so each call reads from DRAM."""
    dtype, pack, gemm = panel_ops()
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in STEP_SHAPES] + [(VOCAB, HIDDEN)]
    panels = into_huge_pages([pack(torch.randn(n, k, generator=gen).mul(0.02).to(dtype)) for n, k in shapes])
    weight_bytes = sum(n * k for n, k in shapes) * dtype.itemsize
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in {k for _, k in shapes}}

        def step() -> None:
            for (n, k), p in zip(shapes, panels):
                gemm(xs[k], p, n)

        ms = best_us(step, 1, repeats) / 1e3
        out.append({"dtype": str(dtype).removeprefix("torch."), "layers": layers, "rows": rows, "ms": ms,
                    "weight_mb": weight_bytes / 1e6, "gb_s": weight_bytes / ms / 1e6,
                    "gflops": 2 * rows * weight_bytes / dtype.itemsize / ms / 1e6})
    return out


def random_blocks(n: int, k: int, gen: torch.Generator, q8: bool = False) -> tuple[torch.Tensor, ...]:
    """Random GGUF blocks (codes [n, k] int8, d and m [n, k / 32] fp32) as Q4_1 holds them (Q8_0 with `q8`)."""
    codes = torch.randint(-128 if q8 else 0, 128 if q8 else 16, (n, k), generator=gen).to(torch.int8)
    d = (torch.rand(n, k // 32, generator=gen) * 0.002).half().float()
    m = torch.full_like(d, -0.0) if q8 else -(torch.rand(n, k // 32, generator=gen) * 0.02).half().float()
    return codes, d, m


def gguf_block_rows(rows_list: list[int], repeats: int) -> list[dict]:
    """GFLOP/s of each GEMMS shape at each row count over GGUF block panels and over fp32 panels of the same
    weights, on one thread and on all, cache-warm (fp32 activations on either build)."""
    gen = torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    out = []
    for n, k in GEMMS:
        blocks = random_blocks(n, k, gen)
        kinds = {"gguf blocks": pack_block_panels(*blocks),
                 "float32": torch.ops.neuronmm.pack_panels_f32(decode_blocks(*blocks))}
        for rows in rows_list:
            x = torch.randn(rows, k, generator=gen)
            for used in dict.fromkeys((1, threads)):
                torch.set_num_threads(used)
                try:
                    for kind, panels in kinds.items():
                        us = best_us(lambda: torch.ops.neuronmm.panel_linear_f32(x, panels, n), max(20, 20000 // rows),
                                     repeats)
                        out.append({"dtype": kind, "n": n, "k": k, "rows": rows, "threads": used, "us": us,
                                    "gflops": 2 * rows * n * k / us / 1e3})
                finally:
                    torch.set_num_threads(threads)
    return out


def gguf_block_step(rows_list: list[int], repeats: int, layers: int = LAYERS) -> list[dict]:
    """A step's linears as `step_linears` times them, over GGUF block panels (`quantization: gguf`: the layers' weights
    as Q4_1 blocks, the LM head as Q8_0, as the default model's GGUF holds them; random codes) and over fp32 panels
    of the same decoded weights, in turns (fp32 activations on either build)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(layers) for shape in STEP_SHAPES] + [(VOCAB, HIDDEN)]
    blocks, fp32 = [], []
    for i, (n, k) in enumerate(shapes):
        weights = random_blocks(n, k, gen, q8=i == len(shapes) - 1)
        blocks.append(pack_block_panels(*weights))
        fp32.append(torch.ops.neuronmm.pack_panels_f32(decode_blocks(*weights)))
    kinds = {"gguf blocks": into_huge_pages(blocks), "float32": into_huge_pages(fp32)}
    flops = 2 * sum(n * k for n, k in shapes)
    out = []
    for rows in rows_list:
        xs = {k: torch.randn(rows, k, generator=gen) for k in {k for _, k in shapes}}
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(2):  # in turns, so a slow spell of the VM does not fall on one of them
            for kind, panels in kinds.items():
                def step(panels=panels) -> None:
                    for (n, k), p in zip(shapes, panels):
                        torch.ops.neuronmm.panel_linear_f32(xs[k], p, n)
                best[kind] = min(best[kind], best_us(step, 1, repeats) / 1e3)
        for kind, panels in kinds.items():
            weight_bytes = sum(p.numel() * p.element_size() for p in panels)
            out.append({"dtype": kind, "layers": layers, "rows": rows, "ms": best[kind], "weight_mb": weight_bytes / 1e6,
                        "gb_s": weight_bytes / best[kind] / 1e6, "gflops": rows * flops / best[kind] / 1e6})
    return out


def contexts_of(positions: int, uneven: bool) -> list[int]:
    """16 sequences' cached positions: all at `positions`, or (uneven) half at an eighth of it and half at the rest
    of twice it (the same total: a batch of new and long-running conversations)."""
    if not uneven:
        return [positions] * SEQS
    short = max(1, positions // 8)
    return [short] * (SEQS // 2) + [2 * positions - short] * (SEQS - SEQS // 2)


def kv_caches(shape: tuple[int, ...], cache_dtype: torch.dtype,
              gen: torch.Generator) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's random K and V caches of `shape`, on huge pages as the engine's KV pool is (on 4 KB pages a
    batch-16 step's attention ran 1.05-1.07 x slower, 2026-11-30)."""
    def one() -> list[torch.Tensor]:
        return into_huge_pages([torch.randn(shape, generator=gen).to(cache_dtype) for _ in range(LAYERS)])
    return one(), one()


def attention_ms(contexts: list[int], repeats: int, dtype: torch.dtype, cache_dtype: torch.dtype) -> dict:
    """ms for 30 layers of decode attention of a `dtype` model over a cache in `cache_dtype`, one sequence per
    entry of `contexts` (its cached positions), and the cache bytes read per second."""
    seqs, per_seq = len(contexts), max(contexts) // BLOCK + 1
    shape = (seqs * per_seq, KV_HEADS, BLOCK, HEAD_DIM)
    gen = torch.Generator().manual_seed(0)
    k_caches, v_caches = kv_caches(shape, cache_dtype, gen)
    qkv = torch.randn(seqs, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen).to(dtype)
    cos, sin = (torch.randn(seqs, HEAD_DIM, generator=gen).to(dtype) for _ in range(2))
    tables = torch.arange(seqs * per_seq, dtype=torch.int32).reshape(seqs, per_seq)
    slots = torch.tensor([s * per_seq * BLOCK + n - 1 for s, n in enumerate(contexts)])
    seq_index, lens = torch.arange(seqs, dtype=torch.int32), torch.tensor(contexts, dtype=torch.int32)

    def all_layers() -> None:
        for k, v in zip(k_caches, v_caches):
            torch.ops.neuronmm.attention(qkv, cos, sin, k, v, slots, tables, seq_index, lens, HEADS, KV_HEADS,
                                         HEAD_DIM ** -0.5)

    ms = best_us(all_layers, 1, repeats) / 1e3
    cache_bytes = 2 * sum(contexts) * KV_HEADS * HEAD_DIM * cache_dtype.itemsize * LAYERS
    counts = {n: contexts.count(n) for n in dict.fromkeys(contexts)}
    return {"contexts": " + ".join(f"{c} x {n}" for n, c in counts.items()), "positions": sum(contexts) / seqs,
            "layers": LAYERS, "seqs": seqs, "dtype": str(dtype).removeprefix("torch."),
            "cache_dtype": str(cache_dtype).removeprefix("torch."), "ms": ms, "cache_gb_s": cache_bytes / ms / 1e6}


def prefill_attention_ms(prefix: int, tokens: int, repeats: int, cache_dtype: torch.dtype) -> dict:
    """ms and GFLOP/s for 30 layers of an fp32 model's attention of one prompt chunk of `tokens` after `prefix`
    cached positions, its blocks scattered over a cache in `cache_dtype`."""
    gen = torch.Generator().manual_seed(0)
    blocks = -(-(prefix + tokens) // BLOCK)
    table = torch.randperm(blocks + 2, generator=gen)[:blocks].view(1, -1).int()
    positions = torch.arange(prefix, prefix + tokens)
    slots = table[0, positions // BLOCK].long() * BLOCK + positions % BLOCK
    shape = (blocks + 2, KV_HEADS, BLOCK, HEAD_DIM)
    k_caches, v_caches = kv_caches(shape, cache_dtype, gen)
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, generator=gen)
    angles = positions.float().unsqueeze(1) * torch.linspace(0.1, 1.0, HEAD_DIM // 2).repeat(2)
    cos, sin = angles.cos(), angles.sin()
    seq_index, lens = torch.zeros(tokens, dtype=torch.int32), (positions + 1).int()

    def all_layers() -> None:
        for k, v in zip(k_caches, v_caches):
            torch.ops.neuronmm.attention(qkv, cos, sin, k, v, slots, table, seq_index, lens, HEADS, KV_HEADS,
                                         HEAD_DIM ** -0.5)

    ms = best_us(all_layers, 1, repeats) / 1e3
    flops = 4 * HEAD_DIM * HEADS * int(lens.sum()) * LAYERS
    return {"prefix": prefix, "tokens": tokens, "layers": LAYERS,
            "cache_dtype": str(cache_dtype).removeprefix("torch."), "ms": ms, "gflops": flops / ms / 1e6}


def sampler_us(repeats: int) -> dict:
    """µs of the fused greedy argmax and temperature sampling (and torch's argmax) on 16 rows of logits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(SEQS, VOCAB, generator=gen) * 3
    inv_temps, uniforms = torch.full((SEQS,), 1 / 0.7), torch.rand(SEQS, generator=gen)
    ops = torch.ops.neuronmm
    return {"argmax_rows": best_us(lambda: ops.argmax_rows(logits), 200, repeats),
            "sample_temperature": best_us(lambda: ops.sample_temperature(logits, inv_temps, uniforms), 200, repeats),
            "torch_argmax": best_us(lambda: logits.argmax(-1), 200, repeats)}


def markdown(report: dict) -> str:
    lines = [f"CPU flags {' '.join(report['cpu_flags'])}; caps {report['caps_in_force'] or 'none'}", "",
             "| GEMM | dtype | rows | µs | GFLOP/s |", "|---|---|---:|---:|---:|"]
    lines += [f"| {g['n']} x {g['k']} | {g['dtype']} | {g['rows']} | {g['us']:.1f} | {g['gflops']:.0f} |"
              for g in report["gemm"]]
    if report.get("gguf_gemm"):
        lines += ["", "| GEMM | weights | rows | threads | µs | GFLOP/s |", "|---|---|---:|---:|---:|---:|"]
        lines += [f"| {g['n']} x {g['k']} | {g['dtype']} | {g['rows']} | {g['threads']} | {g['us']:.1f} | "
                  f"{g['gflops']:.0f} |" for g in report["gguf_gemm"]]
    lines += ["", "| a step's linears | dtype | rows | ms | weights MB | GB/s | GFLOP/s |",
              "|---|---|---:|---:|---:|---:|---:|"]
    lines += [f"| {s['layers']} layers + LM head | {s['dtype']} | {s['rows']} | {s['ms']:.2f} | {s['weight_mb']:.0f} | "
              f"{s['gb_s']:.1f} | {s['gflops']:.0f} |" for s in report["step_linears"]]
    for a in report["attention"]:
        lines += ["", f"Attention, {a['layers']} layers x sequences at {a['contexts']} positions "
                      f"({a['dtype']} model, {a['cache_dtype']} cache): {a['ms']:.2f} ms, {a['cache_gb_s']:.1f} GB/s of "
                      "cache read"]
    for a in report["prefill_attention"]:
        lines += ["", f"Prefill attention, {a['layers']} layers, {a['tokens']} tokens after {a['prefix']} "
                      f"(float32 model, {a['cache_dtype']} cache): {a['ms']:.2f} ms, {a['gflops']:.0f} GFLOP/s"]
    lines += ["", "Sampler, 16 x 49,152: " + ", ".join(f"{k} {v:.0f} µs" for k, v in report["sampler"].items())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: time the ops, print a table, save JSON and markdown."""
    p = argparse.ArgumentParser(prog="bench.cpu_ops", description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=positive_int, nargs="+", default=[1, 4, 16, 32, 128, 512])
    p.add_argument("--step-rows", type=positive_int, nargs="+", default=[1, 16])
    p.add_argument("--step-layers", type=positive_int, default=LAYERS)
    p.add_argument("--positions", type=positive_int, default=320)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--prefill-chunks", nargs="+", default=["0:128", "1536:512"], metavar="PREFIX:TOKENS",
                   help="prompt chunks whose attention to time (TOKENS new positions after PREFIX cached ones)")
    p.add_argument("--gguf-blocks", action="store_true",
                   help="also a step's linears, and the panel GEMMs on one thread and on all, over GGUF block "
                        "panels beside fp32 panels of the same weights")
    p.add_argument("--out", default=str(RESULTS / "cpu_ops.json"))
    args = p.parse_args(argv)
    try:
        chunks = [tuple(int(n) for n in chunk.split(":")) for chunk in args.prefill_chunks]
        if any(len(c) != 2 or c[0] < 0 or c[1] < 1 for c in chunks):
            raise ValueError
    except ValueError:
        p.error("--prefill-chunks takes PREFIX:TOKENS pairs, e.g. 0:128 (PREFIX >= 0, TOKENS >= 1)")
    out = check_out(args.out)
    if not fused_ops.load():
        p.exit(2, "bench.cpu_ops: the fused CPU ops could not be built here (see the log above)\n")
    report = {**machine_facts(), "torch_threads": torch.get_num_threads(), "gemm": gemm_rows(args.rows, args.repeats),
              "gguf_gemm": gguf_block_rows(args.rows, args.repeats) if args.gguf_blocks else [],
              "step_linears": step_linears(args.step_rows, args.repeats, args.step_layers)
              + (gguf_block_step(args.step_rows, args.repeats, args.step_layers) if args.gguf_blocks else []),
              "attention": [attention_ms(contexts_of(args.positions, uneven), args.repeats, *dtypes)
                            for uneven in (False, True) for dtypes in ATTENTION_DTYPES],
              "prefill_attention": [prefill_attention_ms(prefix, tokens, args.repeats, cache_dtype)
                                    for prefix, tokens in chunks for cache_dtype in (torch.float32, torch.float16)],
              "sampler": sampler_us(args.repeats)}
    return publish(out, report, markdown(report))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
