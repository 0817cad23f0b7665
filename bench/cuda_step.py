"""Decode step time on CUDA, replayed from captured graphs against op by op (`engine.enforce_eager`).

The model is the default model's architecture with random weights (a step's time does not depend on the values, and
a GPU machine may not hold the GGUF): config.json and tokenizer from `--model-config`, a folder such as the converted
default model in ~/.cache/neuronmm/models. Otherwise as bench.engine_step: sequences of a 128-token random prompt in
the paged cache, then single-token decode steps of all of them (model forward + logits, no sampling).

    python -m bench.cuda_step --batch-sizes 1 16 64
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from bench.engine_step import RESULTS, step_times
from bench.harness import (MODEL_DTYPES, check_out, machine_facts, nonnegative_int, positive_int, publish, run_cli,
                           torch_device)
from server.backends.torch_runner import TorchRunner
from server.config import load_config
from server.models.source import resolve_model_dir

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "generation_config.json")


def random_model(config_dir: Path, out: Path, seed: int) -> Path:
    """A model folder with config_dir's architecture and tokenizer and random weights."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig.from_pretrained(config_dir)).save_pretrained(out)
    for name in _TOKENIZER_FILES:
        if (config_dir / name).is_file():
            shutil.copy(config_dir / name, out / name)
    return out


def rows_for(model_dir: Path, args, dtype: str, graphs: bool, block_size: int) -> list[dict]:
    """Step p50 / min per batch size for one dtype, replayed (graphs) or op by op."""
    max_len = args.context + args.steps + 6
    runner = TorchRunner(model_dir, max_len, dtype, args.device, cuda_graphs=graphs)
    runner.load()
    runner.allocate_kv_blocks(max(args.batch_sizes) * -(-max_len // block_size), block_size)
    rows = []
    with torch.inference_mode():
        for bs in args.batch_sizes:
            times = step_times(runner, bs, args.context, args.steps + 5, args.seed, block_size)[5:]
            p50 = statistics.median(times)
            rows.append({"dtype": runner.precision, "cuda_graphs": runner.graphs is not None, "batch_size": bs,
                         "step_ms_p50": 1000 * p50, "step_ms_min": 1000 * min(times), "tok_s": bs / p50})
    return rows


def main(argv: list[str] | None = None) -> int:
    """CLI entry: time decode steps per dtype, graphs on and off, print a table, save JSON and markdown."""
    p = argparse.ArgumentParser(prog="bench.cuda_step", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/smollm2-135m.yaml")
    p.add_argument("--model-config", help="a folder with config.json and the tokenizer (default: the config's model)")
    p.add_argument("--device", type=torch_device, default="cuda", metavar="{cpu,cuda,cuda:N}")
    p.add_argument("--dtypes", nargs="+", choices=MODEL_DTYPES, default=["auto", "float32"])
    p.add_argument("--batch-sizes", type=positive_int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=positive_int, default=128)
    p.add_argument("--steps", type=positive_int, default=60, help="timed steps per batch size (first 5 dropped)")
    p.add_argument("--seed", type=nonnegative_int, default=0)
    p.add_argument("--out", default=str(RESULTS / "cuda_step.json"))
    args = p.parse_args(argv)
    out = check_out(args.out)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        p.error("no CUDA device: this benchmark times the CUDA path (--device cpu runs the same steps on the CPU)")
    cfg = load_config(args.config)
    config_dir = Path(args.model_config) if args.model_config else resolve_model_dir(cfg.model, cfg.cache_path)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = random_model(config_dir, Path(tmp), args.seed)
        for dtype in tqdm(args.dtypes, desc="dtypes"):
            for graphs in (True, False) if args.device.startswith("cuda") else (False,):
                rows += rows_for(model_dir, args, dtype, graphs, cfg.engine.block_size)
    device = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "cpu"
    report = {**machine_facts(), "device": device, "torch": torch.__version__, "model": cfg.model.name,
              "weights": "random (the model's architecture)", "context": args.context,
              "block_size": cfg.engine.block_size, "rows": rows}
    eager = {(r["dtype"], r["batch_size"]): r["step_ms_p50"] for r in rows if not r["cuda_graphs"]}
    md = [f"Decode step on {device} (torch {torch.__version__}), {cfg.model.name} architecture, random weights:", "",
          "| dtype | batch | step | p50 ms | min ms | tok/s | eager / this |", "|---|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        mode = "graph replay" if r["cuda_graphs"] else "op by op"
        ratio = eager[(r["dtype"], r["batch_size"])] / r["step_ms_p50"]
        md.append(f"| {r['dtype']} | {r['batch_size']} | {mode} | {r['step_ms_p50']:.2f} | {r['step_ms_min']:.2f} | "
                  f"{r['tok_s']:.0f} | {ratio:.2f} x |")
    return publish(out, report, "\n".join(md) + "\n")


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
