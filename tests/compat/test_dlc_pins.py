"""The compat job's pins (tests/compat/requirements-dlc.txt) are the Neuron DLC's stack as versions.py states it."""

from __future__ import annotations

import re
from pathlib import Path

from server.backends.neuron import versions

REQUIREMENTS = Path(__file__).with_name("requirements-dlc.txt")


def _pins() -> dict[str, str]:
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        match = re.match(r"([A-Za-z0-9_.-]+)==([0-9.]+)", line.split("#")[0].strip())
        if match:
            pins[match[1].lower()] = match[2]
    return pins


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version.split("."))


def test_compat_pins_are_the_dlc_stack():
    pins = _pins()
    assert pins["transformers"].startswith(versions.DLC_TRANSFORMERS + ".")
    assert _release(pins["numpy"]) < _release(versions.DLC_NUMPY_BELOW)
    assert "torch" in pins  # stays the CPU wheel on disk; the DLC's torch 2.7 does not install beside it
