"""The one Neuron SDK release this backend targets, with its exact package pins (used by docs, Docker, tests)."""

from __future__ import annotations

# Neuron SDK 2.25.0 (2025-07-31): the last release whose DLC image still carries transformers-neuronx.
# Sources: the 2.25.0 release-content page (neuronx-cc) and AWS's own DLC Dockerfile for
# pytorch-inference-neuronx 2.7.0 / SDK 2.25.0 (torch-neuronx, transformers-neuronx, runtime pins).
# What changes after it (aws-neuron-sdk docs, checked at commit 0521004c and HEAD 81ce03ae):
# - 2.26 still ships transformers-neuronx: the SDK's package manifest lists transformers-neuronx
#   0.13.1315 for 2.26.0 and 2.26.1 (src/helperscripts/n2-manifest.json:489, :454; 2.25.0 has
#   0.13.1216 at :524) and for no later release. Only the images dropped it: 2.26.0 starts its
#   end-of-support, and the PyTorch inference DLC/DLAMI no longer include the package or its venv
#   (release-notes/2.26.0/containers.rst:31, index.rst:204). A 2.26 host could pip-install it; we
#   stay on 2.25, the last DLC that carries it (docker/Dockerfile.neuron builds on that image).
# - `neuronxcc.nki.*`: removal announced for 2.28, moved to 2.29 (NKI 2.28 notes,
#   release-notes/components/nki.rst:579-580), postponed again at 2.29 to a later release (:422);
#   from 2.30 its use inside a kernel is a compile error (:273). Our kernels import it through
#   neuronmm_kernels.compat.
# The DLC's Python stack, which the serving code runs under there: Python 3.10, transformers 4.48.*,
# numpy<1.24. .ci/run's compat job runs the serving, engine and backend tests under these
# (tests/compat/requirements-dlc.txt; tests/compat/test_dlc_pins.py keeps the two in step).
NEURON_SDK = "2.25.0"
NEURONX_CC = "2.20.9961.0"
TORCH_NEURONX = "2.7.0.2.9.9357+08e1f40d"
TRANSFORMERS_NEURONX = "0.13.1216"
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
DLC_PYTHON = "3.10"
DLC_TRANSFORMERS = "4.48"  # minor series: transformers==4.48.*
DLC_NUMPY_BELOW = "1.24"  # numpy<1.24
DLC_IMAGE = "public.ecr.aws/neuron/pytorch-inference-neuronx:2.7.0-neuronx-py310-sdk2.25.0-ubuntu22.04"

PIP_PINS = {
    "neuronx-cc": NEURONX_CC,
    "torch-neuronx": TORCH_NEURONX,
    "transformers-neuronx": TRANSFORMERS_NEURONX,
}
