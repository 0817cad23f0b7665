"""`neuronmm compress`: whitened (or plain) block-aligned SVD of a model's MLP, or structured pruning of its
intermediate channels in blocks (--method prune), into an artifact directory."""

from __future__ import annotations

import argparse
import json
import logging
import resource
import shutil
import tempfile
import time
from pathlib import Path

import torch
from pydantic import ValidationError

from compression.compress import CompressSettings, check_sensitivity_cache, compress_model
from compression.prune_artifact import check_prune_settings, prune_compress_model
from compression.recovery import recover_artifact
from compression.recovery.recover import check_seqlen, pick_device
from server.config import Config, RecoveryConfig, load_config, validate_section
from server.errors import ConfigError, first_error
from server.models.artifact import check_artifact_out
from server.models.source import resolve_model_dir

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `compress` subcommand."""
    p = subparsers.add_parser("compress", help="compress a model's MLP (whitened SVD, or structured pruning of its "
                                               "channels) into an artifact")
    p.add_argument("--config", help="YAML config (default: the packaged configs/smollm2-135m.yaml); its `compression:` "
                                    "block gives defaults")
    p.add_argument("--keep-ratio", type=float, help="fraction of each matrix's parameters kept, in (0, 1]")
    p.add_argument("--method", choices=["whitened", "plain", "prune"],
                   help="whitened (default) or plain SVD factors; prune: remove whole blocks of --rank-multiple MLP "
                        "channels (one narrower dense matmul per projection; down_proj refit by default)")
    p.add_argument("--prune-order", choices=["obs", "energy"],
                   help="--method prune: the order channels leave a layer in (obs: Optimal Brain Surgeon with down_proj "
                        "compensated, default; energy: E[h^2]·|down column|^2)")
    p.add_argument("--targets", choices=["mlp", "mlp+attn"])
    p.add_argument("--rank-multiple", type=int, help="every rank is a multiple of this (128 tiles Trainium); with "
                                                     "--method prune, the channels removed per block")
    p.add_argument("--calib-samples", type=int, help="number of calibration windows")
    p.add_argument("--calib-seqlen", type=int, help="tokens per calibration window")
    p.add_argument("--calib-data", help="calibration jsonl (default: the config's compression.calib_data)")
    p.add_argument("--seed", type=int)
    p.add_argument("--allocation", choices=["exact", "measured", "sensitivity", "uniform"],
                   help="rank allocation (sensitivity, the default: Fisher-weighted whitened truncation loss on the dense "
                        "model, spent greedily one rank step at a time; exact: the same measure and budget spread by an "
                        "exact knapsack over each matrix's rank options and dense; measured: the exact knapsack on the "
                        "measured rise of the next-token loss on held-out calibration windows with each option "
                        "applied; uniform: the rank formula per matrix, fastest)")
    p.add_argument("--score-windows", type=int, help="--allocation measured: held-out scoring windows (default 8)")
    p.add_argument("--score-seqlen", type=int, help="--allocation measured: tokens per scoring window (default 256)")
    p.add_argument("--measured-rounds", type=int,
                   help="--allocation measured: rounds re-measuring every option with the other matrices at the "
                        "previous round's ranks (default 1; 0: single-matrix scores only)")
    p.add_argument("--sensitivity", choices=["fisher", "normalised"],
                   help="allocation measure: fisher (truncation loss weighted by the output Fisher, default) or "
                        "normalised (each matrix's relative output error)")
    p.add_argument("--latency-model", choices=["none", "trn1"],
                   help="trn1: break allocation ties toward the kernels' cost model and record MODELED MLP latency")
    p.add_argument("--refit", action=argparse.BooleanOptionalAction, default=None,
                   help="after truncation, refit each B factor by least squares on the compressed model's inputs "
                        "against the dense layer's outputs (default off: it raised perplexity at keep 0.8, "
                        "docs/BENCHMARKS.md); with --method prune, refit down_proj on the kept channels (default on)")
    p.add_argument("--sensitivity-cache", help="JSON file keeping the allocation's pre-passes (spectra and Fisher "
                                               "weights; the measured allocation's scores per round): each reused "
                                               "when model, calibration and settings match, else written; for "
                                               "allocation experiments")
    p.add_argument("--recover", choices=["lora", "distill"],
                   help="after compressing, recover the factors: lora = LoRA with the next-token loss, distill = KL to "
                        "the dense model + 0.5 x the next-token loss (`neuronmm recover` defaults; see its --help)")
    p.add_argument("--recover-train", choices=["lora", "factors"],
                   help="with --recover distill: train LoRA adapters (default) or the factors themselves")
    p.add_argument("--recover-steps", type=int, help=f"with --recover: training steps (default {RECOVER_STEPS})")
    p.add_argument("--recover-windows", type=int, help="with --recover: distinct training windows (default steps x "
                                                        "batch size); fewer are revisited, see `neuronmm recover`")
    p.add_argument("--recover-ce-weight", type=float, help="with --recover distill: weight of the next-token "
                                                           "cross-entropy added to the KL (default 0.5; 0: KL only)")
    p.add_argument("--recover-hidden-loss", type=float, help="with --recover distill: weight of the hidden-state "
                                                             "loss (see `neuronmm recover --hidden-loss`)")
    p.add_argument("--recover-lr", type=float, help="with --recover: peak learning rate (default as `neuronmm "
                                                    "recover`'s: 1e-3 for LoRA, 1e-4 for the factors)")
    p.add_argument("--num-threads", type=int, default=2, help="torch threads (the CPU is shared)")
    p.add_argument("--out", required=True, help="artifact directory to write: an earlier artifact there is replaced "
                                                "atomically; any other folder or file is refused")
    p.set_defaults(func=_run)


RECOVER_STEPS = 200  # --recover's training steps unless --recover-steps says


def check_rank_multiple(rank_multiple: int, model_dir: Path) -> None:
    """ConfigError (one line) where no rank of that multiple saves parameters on the model's MLP matrices: the run
    would calibrate for minutes and write an artifact that factors nothing."""
    config = json.loads((model_dir / "config.json").read_text())
    m, n = config.get("hidden_size"), config.get("intermediate_size")
    if m and n and rank_multiple * (m + n) >= m * n:
        raise ConfigError(f"--rank-multiple {rank_multiple}: no rank of that multiple saves parameters on the MLP's "
                          f"{m} x {n} matrices (it must stay under {m * n // (m + n)})")


def settings_from(args: argparse.Namespace, cfg: Config) -> CompressSettings:
    """CompressSettings: CLI flags over the config's compression block (a bad value names its flag)."""
    flags = {name: getattr(args, name) for name in CompressSettings.model_fields
             if getattr(args, name, None) is not None}
    # Only the keys the config sets: fields it leaves out take CompressSettings' defaults (allocation, refit), which
    # the server's config schema does not know about.
    try:
        settings = CompressSettings.model_validate({**cfg.compression.model_dump(exclude_unset=True), **flags})
    except ValidationError as exc:
        name = str(exc.errors()[0]["loc"][0])
        raise ConfigError("--" + first_error(exc).replace(name, name.replace("_", "-"), 1)) from None
    if settings.method == "prune":
        check_prune_settings(settings)
        if args.sensitivity_cache:
            raise ConfigError("--sensitivity-cache keeps the SVD allocation's pre-passes; --method prune does not use it")
    elif settings.allocation == "exact" and settings.sensitivity != "fisher":  # fail before minutes of calibration
        raise ConfigError("--allocation exact needs --sensitivity fisher (normalised losses of different matrices "
                          "are not in one unit)")
    return settings


# `--recover-<name>` flags that map 1:1 onto RecoveryConfig fields, and what their error says they need
_RECOVER_FLAGS = {"steps": "", "lr": "", "windows": "", "hidden_loss": " distill", "ce_weight": " distill"}


def recovery_settings(args: argparse.Namespace, cfg: Config) -> RecoveryConfig | None:
    """RecoveryConfig for --recover (None without it): the config's recovery block with the flags over it."""
    optional = {name: getattr(args, f"recover_{name}") for name in _RECOVER_FLAGS}
    if args.recover is None:
        if args.recover_train is not None:
            raise ConfigError("--recover-train needs --recover distill")
        for name, value in optional.items():
            if value is not None:
                raise ConfigError(f"--recover-{name.replace('_', '-')} needs --recover{_RECOVER_FLAGS[name]}")
        return None
    if args.recover == "lora" and args.recover_train not in (None, "lora"):
        raise ConfigError("--recover-train factors needs --recover distill (--recover lora trains LoRA adapters)")
    flags = {"objective": "next_token" if args.recover == "lora" else "distill", "train": args.recover_train or "lora",
             "steps": RECOVER_STEPS, "num_threads": args.num_threads}
    flags.update({name: value for name, value in optional.items() if value is not None})
    return validate_section(RecoveryConfig, {**cfg.recovery.model_dump(), **flags}, f"--recover {args.recover}")


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.num_threads < 1:
        raise ConfigError(f"--num-threads: expected a positive integer, got {args.num_threads}")
    cfg = load_config(args.config)
    settings = settings_from(args, cfg)
    rcfg = recovery_settings(args, cfg)  # checked before the (minutes-long) compression, not after
    if rcfg is not None:
        pick_device(rcfg.device)
    out = check_artifact_out(Path(args.out))  # so are the files it writes
    cache = check_sensitivity_cache(Path(args.sensitivity_cache)) if args.sensitivity_cache else None
    torch.set_num_threads(args.num_threads)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    if settings.method != "prune":
        check_rank_multiple(settings.rank_multiple, model_dir)
    if rcfg is not None:
        check_seqlen(rcfg, model_dir)
    # With --recover the compressed artifact is staged beside --out and only the recovered one is published there:
    # an interrupted recovery must not leave an unrecovered artifact that looks finished.
    staging = None
    if rcfg is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.unrecovered-", dir=out.parent))
    try:
        first = staging / "artifact" if staging else out
        if settings.method == "prune":
            manifest = prune_compress_model(model_dir, settings, first, model_id=cfg.model.name)
        else:
            manifest = compress_model(model_dir, settings, first, model_id=cfg.model.name, sensitivity_cache=cache)
        if rcfg is not None:
            recover_artifact(first, model_dir, rcfg, out_dir=out)
    finally:
        if staging:
            shutil.rmtree(staging, ignore_errors=True)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
    counts = manifest.parameters
    unit = "block" if settings.method == "prune" else "rank multiple"
    print(f"compressed {cfg.model.name} ({settings.method}, keep_ratio {settings.keep_ratio}, {unit} "
          f"{settings.rank_multiple}) -> {out}: model parameters {counts.model_before} -> {counts.model_after} "
          f"({counts.model_ratio:.3f}); wall {time.perf_counter() - started:.1f} s, peak RSS {peak_mib:.0f} MiB")
    return 0
