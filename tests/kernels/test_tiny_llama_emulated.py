"""A tiny Llama whose MLPs run through the emulated lowrank_mlp kernel matches the torch low-rank model."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from neuronmm_kernels.emulator import run
from neuronmm_kernels.kernels.lowrank_mlp import lowrank_mlp
from neuronmm_kernels.reference import BF16
from server.models.lowrank import LowRankLinear

HIDDEN, INTER, RANK = 128, 256, 128


def _tiny_lowrank_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    for layer in model.model.layers:
        mlp = layer.mlp
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(mlp, name)
            # bf16-representable factors so the kernel (bf16 inputs) and torch (fp32) see the same weights
            a = (torch.randn(RANK, lin.in_features) / lin.in_features ** 0.5).bfloat16().float()
            b = (torch.randn(lin.out_features, RANK) / RANK ** 0.5).bfloat16().float()
            setattr(mlp, name, LowRankLinear(a, b))
    return model


def _kernel_mlp(mlp):
    """forward replacement: flatten tokens, run the emulated NKI kernel, return float32."""
    def to_np(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().numpy().astype(BF16)

    weights = [to_np(w) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj) for w in (p.A.T, p.B.T)]

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = to_np(x.reshape(-1, x.shape[-1]))
        y, _ = run(lowrank_mlp, flat, *weights)
        return torch.from_numpy(y.astype(np.float32)).reshape(x.shape)

    return forward


@torch.no_grad()
def test_logits_match_torch_lowrank_model():
    model = _tiny_lowrank_llama()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(1))  # 18 tokens: a tail
    want = model(ids).logits
    for layer in model.model.layers:
        layer.mlp.forward = _kernel_mlp(layer.mlp)
    got = model(ids).logits
    assert torch.isfinite(got).all()
    scale = want.std().item()
    err = (got - want).abs().max().item()
    assert err < 0.1 * scale, (err, scale)  # bf16 activations inside the kernel, fp32 in torch (~0.04 here)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.85  # random logits: near ties
    # and the kernel path really changes something: a wrong weight is caught
    model.model.layers[0].mlp.forward = _kernel_mlp(_tiny_lowrank_llama().model.layers[1].mlp)
    assert (model(ids).logits - want).abs().max().item() > scale
