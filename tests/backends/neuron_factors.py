"""Random low-rank MLP factors for layer 1, prepared as the Neuron backend prepares an artifact's (shared by the
patch tests)."""

from __future__ import annotations

import numpy as np

from server.backends.neuron.layout import LayerFactors, layer_keys, prepare_layer


def random_layer_factors(hidden: int, inter: int, tp_degree: int) -> dict[int, LayerFactors]:
    """{1: prepared factors} of rank 128 for gate, up and down, seeded."""
    rng = np.random.default_rng(0)
    t = {}
    for proj in ("gate", "up", "down"):
        in_dim, out_dim = (inter, hidden) if proj == "down" else (hidden, inter)
        a, b = layer_keys(1, proj)
        t[a], t[b] = rng.standard_normal((128, in_dim)), rng.standard_normal((out_dim, 128))
    return {1: prepare_layer(t, 1, tp_degree=tp_degree)}
