"""Where the shared evaluation data lives: ../shared/data beside the repo, or $NEURONMM_DATA_DIR."""

from __future__ import annotations

import os
from pathlib import Path

from server.errors import ConfigError

_REPO = Path(__file__).resolve().parents[2]


def data_dir() -> Path:
    """The data root (env NEURONMM_DATA_DIR overrides the default ../shared/data)."""
    env = os.environ.get("NEURONMM_DATA_DIR")
    return Path(env).expanduser() if env else (_REPO.parent / "shared" / "data").resolve()


def data_file(*parts: str) -> Path:
    """A file under the data root; a missing one is a one-line ConfigError naming the path."""
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        raise ConfigError(f"evaluation data not found: {path} (set NEURONMM_DATA_DIR)")
    return path
