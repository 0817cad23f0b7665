"""Tile selection: pick a kernel's block sizes by minimising modeled trn1 time under SBUF/PSUM limits.

The analytical-selector idea of PIM-LLM applied to our kernels: enumerate a small grid of block
sizes, trace each candidate with the emulator (trace-only, loop-sampled: milliseconds), drop the
ones that break a hardware rule (SBUF > 176 KiB or PSUM > 8 banks live), keep the fastest (near
ties go to the one that moves fewer HBM bytes). Results are cached per shape.
"""

from __future__ import annotations

import functools
import itertools
import logging

from .emulator import NKIRuleError

log = logging.getLogger(__name__)

KINDS = ("dense_matmul", "lowrank_matmul", "lowrank_mlp")


# Blocks above 512 tokens read every factor once for more tokens (prefill); SBUF caps them (the
# (XU)ᵀ strips and Xᵀ of a whole block stay resident), and the selector drops those that do not fit.
TOKEN_BLOCKS = (128, 256, 512, 768, 1024, 2048)  # 768: Qwen3-4B's down Xᵀ of 1024 tokens is 2 KiB over SBUF
PSUM_TOKENS = 512  # one fp32 PSUM bank: blocks above it run in chunks of this many tokens


def _token_blocks(num_tokens: int) -> list[int]:
    return sorted({min(num_tokens, b) for b in TOKEN_BLOCKS})


# Feature-major activations (lowrank_matmul transpose_in / transpose_out): K-chunk sizes in 128-row tiles,
# and rows per partition for Xᵀ loads and Yᵀ stores. A feature-major row is tokens * 2 bytes, so 4 rows make
# a 4 KiB DMA run at 512 tokens; at <= 128 tokens only 16 rows do (offered there only: tracing is cheap).
K_CHUNKS = (4, 8, 16, 32)
ROW_PACKS = (1, 2, 4)
SMALL_TOKENS_PACK = 16


def _row_packs(num_tokens: int) -> tuple:
    return ROW_PACKS + ((SMALL_TOKENS_PACK,) if num_tokens <= 128 else ())


def _out_packs(num_tokens: int) -> tuple:
    """Yᵀ rows per partition for a transposed output (store_transposed's pack)."""
    return (1, 4) + ((SMALL_TOKENS_PACK,) if num_tokens <= 128 else ())


def _feature_major_candidates(num_tokens: int, transpose_out: bool) -> list[dict]:
    """lowrank_matmul with Xᵀ input (no u_moving/hoist_u). Rank groups of 2 or 4 PSUM accumulators leave
    banks free for the next group while VectorE adds the last one into the SBUF accumulator."""
    grid = {"token_block": _token_blocks(num_tokens), "group": (2, 4), "out_block": (512, 2048),
            "row_pack": _row_packs(num_tokens), "k_chunk": K_CHUNKS,
            "out_pack": _out_packs(num_tokens) if transpose_out else (1,)}
    keys = list(grid)
    combos = [dict(zip(keys, combo), transpose_in=True) for combo in itertools.product(*(grid[k] for k in keys))]
    return [c for c in combos if c["k_chunk"] % c["row_pack"] == 0 and c["out_block"] % (128 * c["out_pack"]) == 0]


def candidates(kind: str, num_tokens: int, transpose_out: bool = False, transpose_in: bool = False) -> list[dict]:
    """Every block-size combination the selector considers for this kernel kind."""
    if transpose_in:
        if kind != "lowrank_matmul":
            raise ValueError(f"transpose_in is a lowrank_matmul option, not {kind!r}'s")
        return _feature_major_candidates(num_tokens, transpose_out)
    tbs = _token_blocks(num_tokens)
    outs = (128, 512, 1024, 2048) if transpose_out else (512, 1024, 2048, 4096)
    if kind == "dense_matmul":
        grid = {"token_block": tbs, "out_block": outs}
    elif kind == "lowrank_matmul":
        grid = {"token_block": tbs, "group": (4, 8), "out_block": outs}
    elif kind == "lowrank_mlp":
        grid = {"token_block": tbs, "group": (4, 8), "gate_block": (128, 256, 512, 1024, 2048), "out_block": outs}
    else:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")
    if kind != "dense_matmul" and num_tokens <= 128:
        grid["u_moving"] = (False, True)
    if kind != "dense_matmul":
        grid["hoist_u"] = (False, True)
    if kind == "lowrank_matmul":
        grid["row_pack"] = (1, 2)
        if transpose_out:  # packed Yᵀ stores (see store_transposed)
            grid["out_pack"] = _out_packs(num_tokens)
    if kind == "lowrank_mlp":
        grid["h_in_hbm"] = (False, True)
    keys = list(grid)
    combos = [dict(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]
    return [c for c in combos if _worth_tracing(c, min(num_tokens, PSUM_TOKENS))
            and c["out_block"] % (128 * c.get("out_pack", 1)) == 0]


def _worth_tracing(c: dict, largest_resident_h_block: int) -> bool:
    """Drop candidates that repeat another's schedule or cannot win, to keep the first selection fast."""
    tb = c["token_block"]
    if tb > PSUM_TOKENS:
        # above one PSUM bank of tokens: the kernels clamp group to 8 / chunks (4 and 8 coincide), and the
        # MLP streams hᵀ by gate_block columns (h_in_hbm unused; narrow blocks cost a VectorE add each, but
        # 256 is what fits SBUF beside a 1024-token block of Llama-3.2-3B's shape)
        return (c.get("group", 8) == 8 and not c.get("h_in_hbm") and c.get("gate_block", 512) >= 256
                and _packs_whole_rows(c))
    # spilling hᵀ only pays when it buys the largest block whose hᵀ is otherwise resident;
    # a resident U makes the group width irrelevant to DMA, so one group size is enough
    return ((not c.get("h_in_hbm") or tb == largest_resident_h_block)
            and (not c.get("hoist_u") or c["group"] == 8) and _packs_whole_rows(c))


def _packs_whole_rows(c: dict) -> bool:
    """row_pack only pays (and is only legal) where U loads whole rows: u_moving or a resident U."""
    return c.get("row_pack", 1) == 1 or bool(c.get("u_moving") or c.get("hoist_u"))


def _model(kind: str, num_tokens: int, dims: tuple, tiles: dict, transpose_out: bool):
    from . import cost_model as cm

    if kind == "dense_matmul":
        return cm.model_dense_matmul(num_tokens, *dims, tiles=tiles)
    if kind == "lowrank_matmul":  # tiles carry transpose_in when the input is feature-major
        return cm.model_lowrank_matmul(num_tokens, *dims, tiles=tiles, transpose_out=transpose_out)
    return cm.model_lowrank_mlp(num_tokens, *dims, tiles=tiles)


# Candidates within this fraction of the fastest count as ties, broken by fewer HBM bytes: at
# PE-bound prefill shapes many token blocks model the same time, and the one that rereads the
# factors least leaves HBM bandwidth to the other NeuronCore and to the next layer's prefetch.
TIE_FRACTION = 0.005


@functools.lru_cache(maxsize=1024)
def _select(kind: str, num_tokens: int, dims: tuple, transpose_out: bool, transpose_in: bool) -> tuple:
    feasible, rejected = [], []
    for tiles in candidates(kind, num_tokens, transpose_out, transpose_in):
        try:
            m = _model(kind, num_tokens, dims, tiles, transpose_out)
        except NKIRuleError as err:
            rejected.append(err.rule)
            continue
        except AssertionError as err:  # a kernel's own precondition (e.g. u_moving with rank > 4096)
            rejected.append(str(err))
            continue
        feasible.append((m.total_us, m.hbm_bytes, tiles))
    if not feasible:
        raise ValueError(f"no feasible tiling for {kind} tokens={num_tokens} dims={dims}: {sorted(set(rejected))}")
    fastest = min(us for us, _, _ in feasible)
    best_us, best_bytes, best = min((f for f in feasible if f[0] <= fastest * (1 + TIE_FRACTION)),
                                    key=lambda f: (f[1], f[0]))
    log.debug("%s tokens=%d dims=%s -> %s (%.1f us modeled, %d HBM bytes)", kind, num_tokens, dims, best, best_us,
              best_bytes)
    return tuple(sorted(best.items()))


def select_tiles(kind: str, num_tokens: int, *dims, transpose_out: bool = False, transpose_in: bool = False) -> dict:
    """Fastest feasible block sizes (kernel kwargs) for a shape by modeled trn1 time (near ties: fewest HBM bytes).

    kind and dims: "dense_matmul" (d_in, d_out), "lowrank_matmul" (d_in, rank, d_out),
    "lowrank_mlp" (hidden, intermediate, ranks) with ranks an int or (r_gate, r_up, r_down).
    Example: select_tiles("lowrank_mlp", 32, 2048, 8192, 1280) -> {"token_block": 32, ...}.
    transpose_in (lowrank_matmul only): x arrives feature-major; the result then includes
    transpose_in=True, ready to pass on as kernel kwargs. Raises ValueError when no candidate fits
    SBUF/PSUM. The first call for a shape traces every candidate (up to ~240 for the MLP: 0.3-3 s
    on a 2-vCPU VM); later calls hit the cache.
    """
    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    norm = tuple(tuple(d) if isinstance(d, (list, tuple)) else (d,) * 3 if kind == "lowrank_mlp" and i == 2 else d
                 for i, d in enumerate(dims))
    return dict(_select(kind, int(num_tokens), norm, bool(transpose_out), bool(transpose_in)))
