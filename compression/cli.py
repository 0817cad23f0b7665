"""`neuronmm compress`: whitened (or plain) block-aligned SVD of a model's MLP into an artifact directory."""

from __future__ import annotations

import argparse
import logging
import resource
import time
from pathlib import Path

from server.errors import ConfigError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `compress` subcommand."""
    p = subparsers.add_parser("compress", help="low-rank compress a model's MLP (whitened SVD) into an artifact")
    p.add_argument("--config", help="YAML config (default: configs/smollm2-135m.yaml); its `compression:` block gives defaults")
    p.add_argument("--keep-ratio", type=float, help="fraction of each matrix's parameters kept, in (0, 1]")
    p.add_argument("--method", choices=["whitened", "plain"])
    p.add_argument("--targets", choices=["mlp", "mlp+attn"])
    p.add_argument("--rank-multiple", type=int, help="every rank is a multiple of this (128 tiles Trainium)")
    p.add_argument("--calib-samples", type=int, help="number of calibration windows")
    p.add_argument("--calib-seqlen", type=int, help="tokens per calibration window")
    p.add_argument("--calib-data", help="calibration jsonl (default: the config's compression.calib_data)")
    p.add_argument("--seed", type=int)
    p.add_argument("--allocation", choices=["uniform", "sensitivity"],
                   help="rank allocation (sensitivity, the default: spread the whole-MLP budget by whitened truncation "
                        "loss measured on the dense model; uniform: the rank formula per matrix, faster)")
    p.add_argument("--sensitivity", choices=["fisher", "normalised"],
                   help="allocation measure: fisher (truncation loss weighted by the output Fisher, default) or "
                        "normalised (each matrix's relative output error)")
    p.add_argument("--latency-model", choices=["none", "trn1"],
                   help="trn1: break allocation ties toward the kernels' cost model and record MODELED MLP latency")
    p.add_argument("--recover", choices=["lora"], help="after compressing, LoRA-recover the factors "
                                                       "(`neuronmm recover` defaults; see its --help)")
    p.add_argument("--recover-steps", type=int, default=200, help="with --recover lora: training steps")
    p.add_argument("--num-threads", type=int, default=2, help="torch threads (the CPU is shared)")
    p.add_argument("--out", required=True, help="artifact directory to write (replaced atomically)")
    p.set_defaults(func=_run)


def settings_from(args: argparse.Namespace, cfg):
    """CompressSettings: CLI flags over the config's compression block."""
    from compression.compress import CompressSettings

    c = cfg.compression
    pick = lambda flag, default: default if flag is None else flag  # noqa: E731
    s = CompressSettings(keep_ratio=pick(args.keep_ratio, c.keep_ratio), method=pick(args.method, c.method),
                         targets=pick(args.targets, c.targets), rank_multiple=pick(args.rank_multiple, c.rank_multiple),
                         calib_samples=pick(args.calib_samples, c.calib_samples),
                         calib_seqlen=pick(args.calib_seqlen, c.calib_seqlen),
                         calib_data=pick(args.calib_data, c.calib_data), seed=pick(args.seed, c.seed),
                         allocation=pick(args.allocation, c.allocation),
                         latency_model=pick(args.latency_model, c.latency_model),
                         sensitivity=pick(args.sensitivity, c.sensitivity))
    if not 0 < s.keep_ratio <= 1:
        raise ConfigError(f"--keep-ratio must be in (0, 1], got {s.keep_ratio}")
    if s.rank_multiple < 1 or s.calib_samples < 1 or s.calib_seqlen < 2:
        raise ConfigError("--rank-multiple, --calib-samples must be >= 1 and --calib-seqlen >= 2")
    return s


def _recover_fn():
    try:
        from compression.recovery import RecoveryConfig, recover_artifact
    except ImportError:
        return None
    return recover_artifact, RecoveryConfig


def _run(args: argparse.Namespace) -> int:
    import torch

    from compression.compress import compress_model
    from server.config import load_config
    from server.models.source import resolve_model_dir

    started = time.perf_counter()
    cfg = load_config(args.config) if args.config else load_config()
    settings = settings_from(args, cfg)
    recover = _recover_fn() if args.recover else None
    if args.recover and recover is None:
        raise ConfigError("--recover lora: compression.recovery is not available in this build")
    if recover is not None:  # check before the (minutes-long) compression, not after
        recover_artifact, RecoveryConfig = recover
        rcfg = RecoveryConfig(steps=args.recover_steps, num_threads=max(1, args.num_threads))
        rcfg.validate()
    torch.set_num_threads(max(1, args.num_threads))
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    out = Path(args.out).expanduser()
    manifest = compress_model(model_dir, settings, out, model_id=cfg.model.name)
    if recover is not None:
        recover_artifact(out, model_dir, rcfg)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    counts = manifest.parameters
    print(f"compressed {cfg.model.name} ({settings.method}, keep_ratio {settings.keep_ratio}, rank multiple "
          f"{settings.rank_multiple}) -> {out}: model parameters {counts.model_before} -> {counts.model_after} "
          f"({counts.model_ratio:.3f}); wall {time.perf_counter() - started:.1f} s, peak RSS {peak_mib:.0f} MiB")
    return 0
