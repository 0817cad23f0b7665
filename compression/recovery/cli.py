"""`neuronmm recover`: recover a compressed artifact's factors (LoRA or whole factors; next-token or distillation
loss) in place (or into --out)."""

from __future__ import annotations

import argparse
from pathlib import Path

from compression.recovery.recover import recover_artifact
from server.config import RecoveryConfig, load_config, validate_section
from server.errors import ConfigError
from server.models.artifact import check_artifact_out
from server.models.source import resolve_model_dir


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `recover` subcommand."""
    p = subparsers.add_parser("recover", help="fine-tune a compressed artifact's factors (LoRA merged back, or the "
                                              "factors themselves) against next tokens or the dense model")
    p.add_argument("--artifact", required=True, help="compressed artifact directory (manifest.json + factors)")
    p.add_argument("--config", help="YAML config naming the source model; its `recovery:` block gives defaults "
                                          "(default: the packaged configs/smollm2-135m.yaml)")
    p.add_argument("--objective", choices=["next_token", "distill"],
                   help="next_token (default): cross-entropy on the text; distill: KL(dense teacher || student) "
                        "per token + --ce-weight x the cross-entropy")
    p.add_argument("--train", choices=["lora", "factors"],
                   help="lora (default): adapters on the factors, merged after; factors: the factors A, B themselves")
    p.add_argument("--steps", type=int)
    p.add_argument("--windows", type=int, help="distinct training windows (default steps x batch size: all new text); "
                                               "fewer are revisited in later epochs, the teacher's states cached")
    p.add_argument("--lr", type=float, help="default 1e-3 with --train lora, 1e-4 with --train factors")
    p.add_argument("--ce-weight", type=float, help="with --objective distill: weight of the next-token cross-entropy "
                                                   "added to the KL (default 0.5; 0: KL only)")
    p.add_argument("--hidden-loss", type=float, help="with --objective distill: weight of a loss on the hidden states "
                                                     "after each layer against the teacher's (default 0: logits only)")
    p.add_argument("--seqlen", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--adapter-rank", type=int)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--num-threads", type=int, help="torch threads (default 2: the CPU is shared)")
    p.add_argument("--device", help="auto (default), cpu or cuda")
    p.add_argument("--data", help="C4 jsonl (default: <data dir>/c4/c4-validation-sample.jsonl)")
    p.add_argument("--out", help="write the recovered artifact here instead of in place")
    p.add_argument("--resume", action="store_true", help="continue from the artifact's last checkpoint")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    artifact = Path(args.artifact)
    if not artifact.is_dir():
        raise ConfigError(f"--artifact {artifact}: no such directory")
    cfg = load_config(args.config)
    keys = ("objective", "train", "steps", "windows", "lr", "hidden_loss", "ce_weight", "seqlen", "batch_size",
            "adapter_rank", "warmup_steps", "checkpoint_every", "seed", "num_threads", "device")
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}
    rcfg = validate_section(RecoveryConfig, {**cfg.recovery.model_dump(), **overrides}, "recovery")
    if args.out:
        check_artifact_out(Path(args.out))  # (recover_artifact checks the device and the windows before its loads)
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    block = recover_artifact(artifact, model_dir, rcfg, out_dir=Path(args.out) if args.out else None,
                             resume=args.resume, data_path=Path(args.data) if args.data else None)
    print(f"recovered {args.out or artifact} ({block['method']}): loss {block['initial_loss']:.3f} -> "
          f"{block['final_loss']:.3f}, {block['tokens']} tokens, {block['wall_s']:.0f} s")
    return 0
