"""`lowrank_mlp` in the calling convention `transformers_neuronx.nki.compile.nki_call` uses.

nki_call hands the kernel its inputs *and* its output HBM tensors as arguments (the pre-2.21
convention: `kernel(x, ..., y)` stores into y and returns nothing), while our `lowrank_mlp`
allocates y itself. NKI only allows shared-HBM allocation at a kernel's top-level scope, so the
adapter cannot call the jit kernel and copy; it runs the same schedule from the kernel's building
blocks (`neuronmm_kernels.kernels._blocks`) and stores straight into the given y, with hᵀ kept in
SBUF (token_block is chosen at trace time so that it fits).
"""

from __future__ import annotations

from neuronmm_kernels.compat import nl
from neuronmm_kernels.kernels._blocks import P, load_transposed, num_tiles, project, split, store_natural, \
    swiglu_transposed

_H_SBUF_BUDGET = 64 * 1024  # bytes per partition for hᵀ (of ~176 KiB usable): room for xᵀ and strips


def pick_token_block(num_tokens: int, intermediate: int, itemsize: int = 2) -> int:
    """Largest of 512/256/128 tokens whose hᵀ strip fits the per-partition SBUF budget."""
    for block in (512, 256, 128):
        if num_tiles(intermediate) * min(block, num_tokens) * itemsize <= _H_SBUF_BUDGET:
            return min(block, num_tokens)
    return min(128, num_tokens)


def lowrank_mlp_body(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y, token_block: int, group: int = 8,
                     gate_block: int = 512, out_block: int = 512):
    """Store (silu(x·Ug·Vg) ⊙ (x·Uu·Vu))·Ud·Vd into y [num_tokens, hidden]; layouts as in lowrank_mlp."""
    num_tokens, hidden = x.shape
    r_gate, inter = gate_v.shape
    r_up, r_down = up_v.shape[0], down_u.shape[1]
    assert all(r % P == 0 for r in (r_gate, r_up, r_down)), "ranks must be multiples of 128"
    assert y.shape == (num_tokens, hidden) and down_v.shape == (r_down, hidden)
    for _, t0, tsz in split(num_tokens, token_block):
        hT = nl.ndarray((P, num_tiles(inter), tsz), dtype=x.dtype, buffer=nl.sbuf)
        for _ in nl.affine_range(1):  # scope: the x-side strips die before the down projection
            xT = nl.ndarray((P, num_tiles(hidden), tsz), dtype=x.dtype, buffer=nl.sbuf)
            load_transposed(x, t0, tsz, xT)
            zgT = nl.ndarray((P, r_gate // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
            project(gate_u, xT, zgT, tsz, group, False)
            zuT = nl.ndarray((P, r_up // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
            project(up_u, xT, zuT, tsz, group, False)
            swiglu_transposed(zgT, zuT, gate_v, up_v, hT, tsz, gate_block)
        zdT = nl.ndarray((P, r_down // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
        project(down_u, hT, zdT, tsz, group, False)
        store_natural(zdT, down_v, y, t0, tsz, out_block)


def lowrank_mlp_into(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y):
    """nki_call entry point: inputs then the output y; the token block is fixed from the static shapes."""
    block = pick_token_block(x.shape[0], gate_v.shape[1])
    lowrank_mlp_body(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y, token_block=block)
