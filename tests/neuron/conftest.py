"""trn1-only suite: every test here is marked `neuron` and skips (with the reason) where the SDK or device is absent.

Run on a trn1 host inside the image (docs/DEPLOY.md, step 6):
    pytest -m neuron tests/neuron -v
Model-level tests read local folders from env: NEURONMM_LLAMA_1B_DIR (HF-format Llama-3.2-1B)
and NEURONMM_LLAMA_1B_ARTIFACT (its keep-0.8 compressed artifact).
"""

from __future__ import annotations

import glob
from pathlib import Path

import pytest


def _sdk_missing() -> str | None:
    try:
        import neuronxcc.nki  # noqa: F401
        import transformers_neuronx  # noqa: F401
    except Exception as exc:  # PyPI placeholders raise on import
        return (f"Neuron SDK 2.25 not importable ({exc.__class__.__name__}); install it from AWS's Neuron pip "
                "repository or run inside docker/Dockerfile.neuron on trn1")
    return None


SDK_MISSING = _sdk_missing()
DEVICE_MISSING = None if glob.glob("/dev/neuron*") else "no /dev/neuron* device (needs a trn1 instance)"


def pytest_configure(config):
    config.addinivalue_line("markers", "device: needs a NeuronCore (nki.baremetal / a compiled model), not only the SDK")


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.neuron)
            if SDK_MISSING:
                item.add_marker(pytest.mark.skip(reason=SDK_MISSING))
            elif DEVICE_MISSING and "device" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=DEVICE_MISSING))
