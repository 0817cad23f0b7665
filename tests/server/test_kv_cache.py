"""KVCache lazy zero-fill: padding becomes finite, written positions are never erased."""

from __future__ import annotations

import torch

from server.models.llama import KVCache


def test_ensure_finite_zeroes_ahead_and_keeps_written_positions():
    cache = KVCache(num_layers=2, num_slots=3, num_kv_heads=1, max_len=600, head_dim=4, dtype=torch.float32)
    for t in cache.k + cache.v:
        t.fill_(float("nan"))
    cache.ensure_finite(1, 1, 5)  # before the forward that writes positions 0..4 of slot 1
    cache.k[0][1, :, :5] = 7.0
    cache.ensure_finite(0, 3, 300)  # a decode group over slots 0..2 reading 300 positions
    for t in cache.k + cache.v:
        assert torch.isfinite(t[:, :, :300]).all()
    assert (cache.k[0][1, :, :5] == 7.0).all()
    assert torch.isnan(cache.k[0][:, :, 599]).all()  # never read, never touched: pages stay uncommitted
