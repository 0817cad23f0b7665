"""Apply a compressed artifact (manifest.json + factors.safetensors) to the serving LlamaModel."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

log = logging.getLogger(__name__)


def apply_compressed_artifact(model: nn.Module, artifact_dir: Path, model_dir: Path) -> int:
    """Replace the artifact's Linears by LowRankLinear (before fusing); a mismatch is a ConfigError.

    The serving model's module names lack HF's `model.` prefix (`layers.3.mlp.down_proj`).
    """
    from compression.artifacts import check_model_hash, load_artifact, swap_in_factors

    artifact_dir = Path(artifact_dir).expanduser()
    manifest, tensors = load_artifact(artifact_dir)
    check_model_hash(manifest, Path(model_dir), f"model.compressed {artifact_dir}")
    count = swap_in_factors(model, manifest, tensors, name_map=lambda name: name.removeprefix("model."))
    log.info("model.compressed %s: %d modules low-rank (%s, keep_ratio %s)", artifact_dir, count,
             manifest.get("method"), manifest.get("keep_ratio"))
    return count
