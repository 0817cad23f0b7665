"""Where the trn1 suite finds its local model folders (env variables, else skip)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def env_dir(name: str) -> Path:
    """A folder named by an environment variable, or skip naming the variable."""
    value = os.environ.get(name)
    if not value or not Path(value).is_dir():
        pytest.skip(f"set {name} to a local folder to run this test")
    return Path(value)
