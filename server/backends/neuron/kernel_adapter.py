"""`lowrank_mlp` in the calling convention `transformers_neuronx.nki.compile.nki_call` uses.

nki_call hands the kernel its inputs *and* its output HBM tensors as arguments (tnx v0.13.0
nki/compile.py:141-160 appends output_HloShapes to the arguments; the kernel stores into y and
returns nothing), while our jit `lowrank_mlp` allocates y itself. So the entry point calls the
kernel's own body, `lowrank_mlp_body`, with the given y and the block sizes the tile selector
picks for this static shape: the decode schedule (U moving, U hoisted) for a few tokens, the
prefill schedule for many, exactly as the standalone kernel would run.
"""

from __future__ import annotations

from neuronmm_kernels.kernels.lowrank_mlp import lowrank_mlp_body
from neuronmm_kernels.tiling import select_tiles


def mlp_tiles(num_tokens: int, hidden: int, intermediate: int, ranks: tuple[int, int, int]) -> dict:
    """The lowrank_mlp block sizes (kernel kwargs) for one compiled shape, by modeled trn1 time."""
    return select_tiles("lowrank_mlp", num_tokens, hidden, intermediate, tuple(ranks))


def lowrank_mlp_into(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y):
    """nki_call entry point: inputs then the output y; block sizes fixed at trace time from the static shapes."""
    num_tokens, hidden = x.shape
    tiles = mlp_tiles(num_tokens, hidden, gate_v.shape[1], (gate_u.shape[1], up_u.shape[1], down_u.shape[1]))
    lowrank_mlp_body(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y, **tiles)
