"""The sampler at the edge of its uniform draws: a draw of exactly 0 picks no token the distribution rules out."""

from __future__ import annotations

import pytest
import torch

from server.engine import sampler
from server.engine.sampling_params import SamplingParams
from server.engine.sequence import Sequence
from server.models import fused_ops


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch"])
def test_a_zero_draw_never_picks_a_token_far_below_the_best(fused, monkeypatch):
    if fused and not fused_ops.load():
        pytest.skip("the fused CPU ops are not built on this machine")
    # token 0 at -200 and tokens 1-4 at -150 under the rest: probabilities below 1e-65, zero in fp32
    logits = torch.zeros(1, 1000)
    logits[0, 0], logits[0, 1:5] = -200.0, -150.0
    monkeypatch.setattr(torch, "rand", lambda *shape, generator=None: torch.zeros(shape))
    monkeypatch.setattr(sampler, "_fused_ops_apply", lambda _logits: fused)
    seq = Sequence("r", 0, [1], SamplingParams(temperature=1.0, seed=7), detok=None)
    tokens, _ = sampler.sample(logits, [seq])
    assert tokens[0] >= 5  # before the clamp, the fused op picked token 0 here
