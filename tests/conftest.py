"""Shared fixtures: the real default model (converted once), a tiny random Llama, a live server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")



@pytest.fixture(scope="session")
def default_config():
    from server.config import load_config

    return load_config()


@pytest.fixture(scope="session")
def smol_dir(default_config) -> Path:
    """SmolLM2-135M-Instruct as a local HF folder (GGUF converted once into ~/.cache/neuronmm)."""
    from server.models.source import resolve_model_dir

    return resolve_model_dir(default_config.model, default_config.cache_path)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smol_dir) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer and chat template (fast, deterministic)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    tok = AutoTokenizer.from_pretrained(smol_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out
