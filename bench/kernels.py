"""Modeled trn1 kernel benchmark: four ways to run the paper's low-rank MLPs, plus the calibration table.

Every number is **modeled** (neuronmm_kernels.cost_model over emulator traces), not measured on a
Neuron device. For each MLP shape of the NeuronMM paper and each token count it models
(a) dense: dense_matmul for gate, up and down (+ a SwiGLU kernel through HBM),
(b) two_matmuls: each low-rank projection as two dense_matmul calls with X·U through HBM (+ SwiGLU),
(c) fused_matmul: lowrank_matmul per projection (+ SwiGLU),
(c') fused_matmul_fm: the same chain with feature-major activations between the kernels (gate/up
     store Yᵀ, SwiGLU on [intermediate, tokens], down reads Xᵀ: no on-chip transposes of X in down),
(d) fused_mlp: one lowrank_mlp call,
each with the tile selector's block sizes, and writes bench/results/kernels.json and kernels.md.
The roofline columns put the fused kernels against max(PE time at peak, minimal HBM bytes / DMA
peak bandwidth), the minimal bytes being X, the factors and Y moved once each (bf16); the layout
changes no byte count. Each lowrank_matmul is reported in both layouts (token-major X and Y, the
kernel-level default; feature-major where the chain uses it), so a layout change is never hidden.

    python -m bench.kernels                        # all shapes, tokens 1 32 128 512 2048
    python -m bench.kernels --models llama-3.2-1b --tokens 1 128
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import time
from pathlib import Path

from tqdm import tqdm

from bench.harness import check_out, machine_facts, positive_int, run_cli, save_report
from neuronmm_kernels import cost_model as cm
from neuronmm_kernels.tiling import select_tiles

RESULTS = Path(__file__).parent / "results"

# NeuronMM paper (arXiv 2510.25977), MLP shapes and the rank it uses for gate/up/down.
PAPER_SHAPES = {
    "llama-3.2-1b": {"hidden": 2048, "intermediate": 8192, "rank": 1280},
    "llama-3.2-3b": {"hidden": 3072, "intermediate": 8192, "rank": 1792},
    "qwen3-1.7b": {"hidden": 2048, "intermediate": 6144, "rank": 1280},
    "qwen3-4b": {"hidden": 2560, "intermediate": 9728, "rank": 1664},
}
TOKENS = (1, 32, 128, 512, 2048)
LABELS = {"dense": "(a) dense", "two_matmuls": "(b) 2 matmuls via HBM", "fused_matmul": "(c) fused XUV",
          "fused_matmul_fm": "(c') fused XUV, feature-major chain", "fused_mlp": "(d) fused MLP"}
# Kernel-level lowrank_matmul runs: (d_in, d_out) picked from the shape, and the layout of X and Y.
XUV_RUNS = {"gate_up": ("h", "i", {}),                          # x [T, H] -> y [T, I], the default
            "gate_up_fm": ("h", "i", {"transpose_out": True}),  # producer in the chain: x [T, H] -> yᵀ [I, T]
            "down": ("i", "h", {}),                             # x [T, I] -> y [T, H], the default
            "down_fm": ("i", "h", {"transpose_in": True})}      # consumer in the chain: xᵀ [I, T] -> y [T, H]
LAYOUTS = {"gate_up": "X, Y token-major", "gate_up_fm": "X token-major, Yᵀ out", "down": "X, Y token-major",
           "down_fm": "Xᵀ in, Y token-major"}


def run_bench(models: list[str], tokens: list[int]) -> dict:
    """Model every (shape, tokens, variant); returns the JSON-ready result."""
    rows = []
    jobs = [(m, t) for m in models for t in tokens]
    for model, num_tokens in tqdm(jobs, desc="modeling", unit="shape"):
        s = PAPER_SHAPES[model]
        row = {"model": model, "num_tokens": num_tokens, **s, "variants": {}}
        for variant in cm.MLP_VARIANTS:
            m = cm.model_mlp(variant, num_tokens, s["hidden"], s["intermediate"], s["rank"])
            row["variants"][variant] = m.as_dict()
        us = {v: row["variants"][v]["modeled_us"] for v in cm.MLP_VARIANTS}
        row["speedup"] = {"c_over_b": us["two_matmuls"] / us["fused_matmul"],
                          "c_over_cfm": us["fused_matmul"] / us["fused_matmul_fm"],
                          "d_over_b": us["two_matmuls"] / us["fused_mlp"],
                          "d_over_a": us["dense"] / us["fused_mlp"],
                          "b_over_a": us["dense"] / us["two_matmuls"]}
        row["xuv_kernels"] = _xuv_kernels(num_tokens, s)
        row["mlp_roofline"] = _mlp_roofline(num_tokens, s)
        rows.append(row)
    calib = {name: {"modeled_ms": round(mod, 3), "published_ms": pub, "error": round(mod / pub - 1, 4)}
             for name, (mod, pub) in cm.calibration().items()}
    return {"label": "modeled (trn1 cost model over NumPy NKI emulator traces; not measured on Neuron)",
            **machine_facts(), "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "machine": f"{platform.node()} {platform.machine()} {platform.python_version()}",
            "calibration": calib, "rows": rows, "mean_speedup": _means(rows)}


def roofline_us(flops: float, min_bytes: float) -> float:
    """Lower bound on a kernel's time: TensorE at peak or the minimal HBM traffic at the DMA peak, whichever is longer."""
    return max(flops / cm.PEAK_FLOPS, min_bytes / cm.DMA_BW_PEAK) * 1e6


def _roofline(m: cm.ModeledTime, flops: float, min_bytes: float) -> dict:
    bound = roofline_us(flops, min_bytes)
    return {"roofline_us": round(bound, 3), "of_roofline": round(bound / m.total_us, 4),
            "bytes_over_min": round(m.hbm_bytes / min_bytes, 3)}


def _mlp_roofline(num_tokens: int, shape: dict) -> dict:
    """The fused MLP against its roofline: X, six factors and Y once each."""
    t, h, i, r = num_tokens, shape["hidden"], shape["intermediate"], shape["rank"]
    flops = 2 * t * r * (3 * h + 3 * i)
    min_bytes = 2 * (2 * t * h + 3 * r * (h + i))
    return _roofline(cm.model_lowrank_mlp(t, h, i, r), flops, min_bytes)


def _xuv_kernels(num_tokens: int, shape: dict) -> dict:
    """Kernel level, as the paper compares: one X·U·V as two dense matmuls via HBM vs fused lowrank_matmul,
    the fused kernel in each layout of XUV_RUNS (the two-matmul baseline is token-major throughout)."""
    dims = {"h": shape["hidden"], "i": shape["intermediate"]}
    r = shape["rank"]
    out = {}
    for name, (a, b, layout) in XUV_RUNS.items():
        d_in, d_out = dims[a], dims[b]
        two = cm.model_dense_matmul(num_tokens, d_in, r) + cm.model_dense_matmul(num_tokens, r, d_out)
        tiles = select_tiles("lowrank_matmul", num_tokens, d_in, r, d_out, **layout)
        fused = cm.model_lowrank_matmul(num_tokens, d_in, r, d_out, tiles=tiles,
                                        transpose_out=layout.get("transpose_out", False))
        out[name] = {"layout": LAYOUTS[name], "tiles": tiles, "two_matmuls_us": round(two.total_us, 3),
                     "fused_us": round(fused.total_us, 3), "speedup": round(two.total_us / fused.total_us, 4),
                     "bound": fused.bound,
                     **_roofline(fused, 2 * num_tokens * r * (d_in + d_out),
                                 2 * (num_tokens * (d_in + d_out) + r * (d_in + d_out)))}
    return out


def _means(rows: list[dict]) -> dict:
    keys = rows[0]["speedup"] if rows else {}
    means = {k: round(sum(r["speedup"][k] for r in rows) / len(rows), 4) for k in keys}
    kernel = [r["xuv_kernels"][k]["speedup"] for r in rows for k in ("gate_up", "down")  # token-major only
              if k in r.get("xuv_kernels", {})]
    if kernel:
        means["xuv_kernel"] = round(sum(kernel) / len(kernel), 4)
        means["xuv_kernel_max"] = round(max(kernel), 4)
    return means


def to_markdown(result: dict) -> str:
    """The per-shape table (modeled µs, HBM MB, TensorE utilisation) plus calibration and means."""
    lines = ["| model | tokens | " + " | ".join(f"{LABELS[v]} µs / MB / PE%" for v in cm.MLP_VARIANTS)
             + " | c/b | c/c' (layout) | d/b | d/a |", "|---|---:|" + "---:|" * (len(cm.MLP_VARIANTS) + 4)]
    for r in result["rows"]:
        cells = [f"{v['modeled_us']:.1f} / {v['hbm_bytes'] / 1e6:.1f} / {100 * v['pe_utilisation']:.0f}"
                 f" ({v['bound']})" for v in (r["variants"][k] for k in cm.MLP_VARIANTS)]
        sp = r["speedup"]
        lines.append(f"| {r['model']} | {r['num_tokens']} | " + " | ".join(cells)
                     + f" | {sp['c_over_b']:.2f}× | {sp['c_over_cfm']:.2f}× | {sp['d_over_b']:.2f}× | "
                     f"{sp['d_over_a']:.2f}× |")
    m = result["mean_speedup"]
    lines += ["", f"Mean modeled speedups: fused XUV over two matmuls (c/b) {m['c_over_b']:.2f}×, the same kernels "
              f"with feature-major activations between them over token-major (c/c') {m['c_over_cfm']:.2f}× (the "
              "two-matmul and dense baselines stay token-major), fused MLP "
              f"over two matmuls (d/b) {m['d_over_b']:.2f}×, fused MLP over dense (d/a) {m['d_over_a']:.2f}×, "
              f"low-rank via two matmuls over dense (b/a) {m['b_over_a']:.2f}×.", "",
              "Kernel level (one X·U·V; the paper's comparison): two dense matmuls via HBM vs fused "
              "`lowrank_matmul`, modeled µs and speedup.", "",
              "| model | tokens | gate/up [H→I] two / fused | × | down [I→H] two / fused | × |",
              "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        k = r["xuv_kernels"]
        lines.append(f"| {r['model']} | {r['num_tokens']} | {k['gate_up']['two_matmuls_us']:.1f} / "
                     f"{k['gate_up']['fused_us']:.1f} | {k['gate_up']['speedup']:.2f}× | "
                     f"{k['down']['two_matmuls_us']:.1f} / {k['down']['fused_us']:.1f} | {k['down']['speedup']:.2f}× |")
    lines += ["", f"Mean kernel-level speedup {m['xuv_kernel']:.2f}× (max {m['xuv_kernel_max']:.2f}×), token-major "
              "X and Y.", "",
              "Fused kernels against their roofline (modeled): share of the roofline reached and HBM bytes "
              "over the minimum (X, factors, Y once each). Layouts: gate/up and down as the kernel-level "
              "default (X, Y token-major); gate/up → Yᵀ stores its output feature-major (the producer in a "
              "feature-major chain); down ← Xᵀ reads a feature-major input (the consumer: no on-chip transposes "
              "of X) and writes Y token-major.", "",
              "| model | tokens | XUV gate/up % / bytes× | gate/up → Yᵀ | XUV down % / bytes× | down ← Xᵀ "
              "| fused MLP % / bytes× |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        k, f = r["xuv_kernels"], r["mlp_roofline"]
        runs = [k[name] for name in ("gate_up", "gate_up_fm", "down", "down_fm") if name in k] + [f]
        cells = [f"{100 * c['of_roofline']:.0f}% / {c['bytes_over_min']:.2f}×" for c in runs]
        lines.append(f"| {r['model']} | {r['num_tokens']} | " + " | ".join(cells) + " |")
    lines += ["",
              "| tutorial schedule (trn1, [4096,8192]×[8192,8192]) | modeled ms | published ms | error |",
              "|---|---:|---:|---:|"]
    for name, c in result["calibration"].items():
        lines.append(f"| {name} | {c['modeled_ms']:.2f} | {c['published_ms']:.2f} | {100 * c['error']:+.1f}% |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """CLI entry: model, print the markdown table, write JSON + markdown under bench/results."""
    ap = argparse.ArgumentParser(prog="bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(PAPER_SHAPES), choices=list(PAPER_SHAPES))
    ap.add_argument("--tokens", nargs="+", type=positive_int, default=list(TOKENS))
    ap.add_argument("--out", type=Path, default=RESULTS / "kernels.json")
    args = ap.parse_args(argv)
    args.out = check_out(args.out)
    start = time.perf_counter()
    result = run_bench(args.models, args.tokens)
    result["wall_s"] = round(time.perf_counter() - start, 1)
    md = to_markdown(result)
    save_report(args.out, result, md)
    print(md)
    print(f"wrote {args.out} and {args.out.with_suffix('.md')} ({result['wall_s']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
