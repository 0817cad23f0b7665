"""Fused low-rank SwiGLU MLP: gate/up share Xᵀ, SiLU(gate)·up stays on-chip (transposed) for down."""

from ..compat import nki, nl
from ._blocks import (MOVING_FMAX, P, blocks, load_columns, load_transposed, num_tiles, project, store_natural,
                      swiglu_down_streamed, swiglu_transposed, transpose_identity)


@nki.jit
def lowrank_mlp(x, gate_u, gate_v, up_u, up_v, down_u, down_v, token_block=512, group=8, gate_block=512,
                out_block=512, u_moving=False, h_in_hbm=False, hoist_u=False):
    """y = (silu(x·gate_u·gate_v) ⊙ (x·up_u·up_v)) · down_u · down_v.

    Layouts (HBM, row-major): x [num_tokens, hidden]; gate_u [hidden, r_gate], gate_v [r_gate,
    intermediate]; up_u [hidden, r_up], up_v [r_up, intermediate]; down_u [intermediate, r_down],
    down_v [r_down, hidden] (U = Aᵀ, V = Bᵀ of LowRankLinear) -> y [num_tokens, hidden].
    dtypes: bf16 in/out; every matmul accumulates in fp32 PSUM; the rank-space strips and the
    activation hᵀ are bf16 TensorE operands. Limits: ranks multiples of 128; num_tokens,
    hidden and intermediate any size >= 1 (e.g. SmolLM2's hidden 576); token_block <= 4096;
    group <= 8; gate_block a multiple of 128; out_block a multiple of 512 (or the tail); u_moving
    as in lowrank_matmul. SBUF must hold hᵀ (intermediate * 2 * token_block / 128 bytes per
    partition): the tile selector shrinks token_block until it fits, or sets h_in_hbm: hᵀ then goes to an HBM scratch written
    feature-major [intermediate, tokens], which the down projection streams back with no transpose.
    hoist_u keeps gate_u and up_u resident in SBUF for the whole kernel (loaded once, whole rows).
    Schedule per token block: Xᵀ (on-chip transposes, once for gate and up); (X·gate_u)ᵀ and (X·up_u)ᵀ
    kept in SBUF; hᵀ = silu(gate)ᵀ ⊙ upᵀ computed with gate_v/up_v stationary, SiLU applied while
    evicting PSUM; (h·down_u)ᵀ with down_u stationary reads hᵀ in place; y token-major.
    NeuronMM round-trips h through HBM between two kernels; here it stays in SBUF (unless h_in_hbm).
    Every factor is read once per token block. A token_block above 512 (prefill: fewer factor
    reloads) streams hᵀ instead: gate_block columns of it at a time, each folded into the down
    projection at once through an fp32 SBUF accumulator (see swiglu_down_streamed); h_in_hbm is
    then unused.
    """
    y = nl.ndarray((x.shape[0], down_v.shape[1]), dtype=x.dtype, buffer=nl.shared_hbm)
    lowrank_mlp_body(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y, token_block, group, gate_block, out_block,
                     u_moving, h_in_hbm, hoist_u)
    return y


def lowrank_mlp_body(x, gate_u, gate_v, up_u, up_v, down_u, down_v, y, token_block=512, group=8, gate_block=512,
                     out_block=512, u_moving=False, h_in_hbm=False, hoist_u=False) -> None:
    """lowrank_mlp's whole schedule, storing into a given y [num_tokens, hidden] (nki_call's convention).

    Kept apart from the jit kernel because shared_hbm outputs may only be created in a kernel's own
    top level: the kernel allocates y and calls this; the serving adapter passes nki_call's y.
    """
    num_tokens, hidden = x.shape
    r_gate, inter = gate_v.shape
    r_up, r_down = up_v.shape[0], down_u.shape[1]
    assert gate_u.shape == (hidden, r_gate) and up_u.shape == (hidden, r_up) and up_v.shape == (r_up, inter)
    assert down_u.shape == (inter, r_down) and down_v.shape == (r_down, hidden)
    assert all(r % P == 0 for r in (r_gate, r_up, r_down)), "ranks must be multiples of 128"
    token_block = min(token_block, num_tokens)
    assert not u_moving or (token_block <= 128 and max(r_gate, r_up, r_down) <= 4096), \
        "u_moving needs <= 128 tokens per block and ranks <= 4096"
    assert 1 <= token_block <= 8 * MOVING_FMAX and 1 <= group <= 8 and gate_block % P == 0
    stream_h = token_block > MOVING_FMAX
    h_in_hbm = h_in_hbm and not stream_h
    assert y.shape == (num_tokens, hidden), (y.shape, x.shape)
    h_hbm = nl.ndarray((inter, num_tokens), dtype=x.dtype, buffer=nl.private_hbm) if h_in_hbm else None
    gu_sbuf = load_columns(gate_u, 0, r_gate) if hoist_u else None
    uu_sbuf = load_columns(up_u, 0, r_up) if hoist_u else None
    ident = transpose_identity(x.dtype)

    def x_side(t0, tsz, zgT, zuT) -> None:
        """(X·gate_u)ᵀ and (X·up_u)ᵀ of one token block into zgT, zuT; Xᵀ is dead afterwards."""
        for _ in nl.sequential_range(1):  # scope: Xᵀ (sequential: the strips are not indexed by it)
            xT = nl.ndarray((P, num_tiles(hidden), tsz), dtype=x.dtype, buffer=nl.sbuf)
            load_transposed(x, t0, tsz, xT, ident)
            project(gate_u, xT, zgT, tsz, group, u_moving, w_sbuf=gu_sbuf, ident=ident)
            project(up_u, xT, zuT, tsz, group, u_moving, w_sbuf=uu_sbuf, ident=ident)

    def token_block_body(_, t0, tsz):
        hT = None if h_in_hbm or stream_h else nl.ndarray((P, num_tiles(inter), tsz), dtype=x.dtype, buffer=nl.sbuf)
        zdT = nl.ndarray((P, r_down // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
        for _ in nl.sequential_range(1):  # scope: X-side strips are dead before the down projection's store
            zgT = nl.ndarray((P, r_gate // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
            zuT = nl.ndarray((P, r_up // P, tsz), dtype=x.dtype, buffer=nl.sbuf)
            x_side(t0, tsz, zgT, zuT)
            if stream_h:
                swiglu_down_streamed(zgT, zuT, gate_v, up_v, down_u, zdT, tsz, gate_block)
            else:
                swiglu_transposed(zgT, zuT, gate_v, up_v, hT, tsz, gate_block, h_hbm, t0)
        if not stream_h:
            project(down_u, hT, zdT, tsz, group, u_moving, h_hbm, t0, ident=ident)
        store_natural(zdT, down_v, y, t0, tsz, out_block)

    blocks(num_tokens, token_block, token_block_body)
