"""Modules built around loaded weights: no random init inside no_init(), weights shared, torch._dynamo left alone."""

import subprocess
import sys

import torch
from torch import nn

from server.models.module_init import linear_around, no_init


def test_no_init_skips_random_init_and_restores_it():
    torch.manual_seed(0)
    with no_init():
        nn.Linear(8, 8), nn.Embedding(4, 8)
    drawn_after_inside = torch.rand(1)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(1), drawn_after_inside)  # building inside drew no random numbers
    torch.manual_seed(0)
    nn.Linear(8, 8)
    assert not torch.equal(torch.rand(1), drawn_after_inside)  # outside, the kaiming init draws again


def test_no_init_restores_on_error():
    reset = nn.Embedding.reset_parameters
    try:
        with no_init():
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert nn.Embedding.reset_parameters is reset


def test_linear_around_shares_the_weight_and_is_frozen():
    weight = torch.randn(6, 4, dtype=torch.bfloat16)
    linear = linear_around(weight)
    assert (linear.in_features, linear.out_features, linear.bias) == (4, 6, None)
    assert linear.weight.data_ptr() == weight.data_ptr() and linear.weight.dtype == torch.bfloat16
    assert not linear.weight.requires_grad
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(linear(x), x @ weight.T)


def test_loading_a_model_does_not_import_dynamo(tiny_model_dir):
    # The meta device imported torch._dynamo at its first op: ~0.9 s of every server start-up.
    code = ("import sys; from server.models.loader import load_llama; "
            f"m = load_llama(__import__('pathlib').Path({str(tiny_model_dir)!r}), 64); "
            "assert all(not p.is_meta for p in m.parameters()); "
            "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("no dynamo")
