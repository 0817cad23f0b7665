"""The one Neuron SDK release this backend targets, with its exact package pins (used by docs, Docker, tests)."""

from __future__ import annotations

# Neuron SDK 2.25.0 (2025-07-31): the last line with both transformers-neuronx and `neuronxcc.nki`.
# Sources: the 2.25.0 release-content page (neuronx-cc) and AWS's own DLC Dockerfile for
# pytorch-inference-neuronx 2.7.0 / SDK 2.25.0 (torch-neuronx, transformers-neuronx, runtime pins).
NEURON_SDK = "2.25.0"
NEURONX_CC = "2.20.9961.0"
TORCH_NEURONX = "2.7.0.2.9.9357+08e1f40d"
TRANSFORMERS_NEURONX = "0.13.1216"
NEURON_PIP_INDEX = "https://pip.repos.neuron.amazonaws.com"
DLC_IMAGE = "public.ecr.aws/neuron/pytorch-inference-neuronx:2.7.0-neuronx-py310-sdk2.25.0-ubuntu22.04"

PIP_PINS = {
    "neuronx-cc": NEURONX_CC,
    "torch-neuronx": TORCH_NEURONX,
    "transformers-neuronx": TRANSFORMERS_NEURONX,
}
