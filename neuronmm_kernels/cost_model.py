"""A trn1 (NeuronCore-v2) cost model: per-engine busy time from an emulator trace, kernel time ≈ max.

Numbers it produces are **modeled**, never measured. Sources (see docs of aws-neuron-sdk v2.26.1,
nki/arch/trainium_inferentia2_arch.rst unless noted):
- TensorE 128x128 at 2.8 GHz; a bf16 matmul costs max(min(64, M_stationary), N_moving) cycles back
  to back (fast LoadStationary), 4x for fp32 operands; PE transpose max(P, min(64, F)).
- ScalarE (act) 1.4 GHz, VectorE (dve) 1.12 GHz: max(64, N) cycles per instruction (N elements per
  partition; 2N for VectorE tensor_tensor without a PSUM or all-bf16 operand) plus ~60 cycles of
  access overhead. ScalarE and VectorE share the PSUM port: their PSUM-touching time serialises.
- DMA: 16 queues per NeuronCore, 272 GB/s per NC peak (nki-dma-overview, trn1); bandwidth
  depends on contiguous bytes per partition row: flat at DMA_BW_SMALL up to 1 KiB (fitted to the
  AWS matmul tutorial, versions 0-2: 5.4/4.4/2.3 GB in 51.8/43.0/22.1 ms), rising log-linearly
  to the peak at 4 KiB ("use >= 2-4 KiB per partition", nki perf guide), and overhead-bound below
  256 B (a row costs at least a 256 B transfer).
- TensorE sustains PE_EFFICIENCY of that cycle count on long matmul streams: fitted to the
  tutorial's fully optimized schedule (PE-bound, published at 85 % of peak).
- Kernel time = max over engines (they run asynchronously; our kernels allocate buffers inside
  loops so the compiler can pipeline) + one DMA latency at each end (first load, last store).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .emulator import TensorSpec, run
from .emulator.core import Trace
from .reference import BF16

PE_HZ, ACT_HZ, DVE_HZ, POOL_HZ = 2.8e9, 1.4e9, 1.12e9, 1.4e9
PEAK_FLOPS = 2 * 128 * 128 * PE_HZ  # 91.75 TFLOPS bf16
DMA_BW_SMALL = 104e9     # B/s for <= 1 KiB contiguous per partition (fit to the tutorial, see above)
DMA_BW_PEAK = 272e9      # B/s per NeuronCore at >= 4 KiB contiguous per partition
DMA_MIN_ROW = 256        # bytes: shorter rows cost as much as a 256 B row
DMA_LATENCY_S = 2e-6     # first-load and last-store latency on the dependency chain (~1.3-2 us)
PE_EFFICIENCY = 0.86     # fraction of back-to-back matmul cycles TensorE sustains (fit: tutorial v3)
INSTR_OVERHEAD = 60      # cycles of SBUF/PSUM access bubble per ACT/DVE/POOL instruction
MIN_II = 64              # minimum instruction initiation interval, cycles

# AWS NKI matmul tutorial, trn1, bf16, [4096, 8192] x [8192, 8192], nki.benchmark P99 (ms).
TUTORIAL_MS = {"tiled": 51.80, "hoisted": 42.96, "block_free": 22.07, "fully_optimized": 6.97}
TUTORIAL_SHAPE = {"K": 8192, "M": 4096, "N": 8192}


def dma_bandwidth(contig_bytes: int) -> float:
    """Effective DMA bandwidth (B/s) for a transfer with this many contiguous bytes per partition."""
    if contig_bytes <= 1024:
        return DMA_BW_SMALL * min(1.0, contig_bytes / DMA_MIN_ROW)
    frac = min(1.0, math.log2(contig_bytes / 1024) / 2)  # 1 KiB -> 0, 4 KiB -> 1
    return DMA_BW_SMALL * (DMA_BW_PEAK / DMA_BW_SMALL) ** frac


@dataclass
class ModeledTime:
    """Modeled trn1 time of one kernel call (or a sum of calls), with what bounds it."""

    total_us: float
    engines_us: dict = field(default_factory=dict)
    hbm_bytes: int = 0
    flops: int = 0
    peak_sbuf_bytes: int = 0
    peak_psum_banks: int = 0
    num_instructions: int = 0
    num_kernels: int = 1

    @property
    def bound(self) -> str:
        """The busiest engine ('pe', 'dma', 'act', 'dve', 'pool' or 'psum_port')."""
        return max(self.engines_us, key=self.engines_us.get) if self.engines_us else "none"

    @property
    def pe_utilisation(self) -> float:
        """Useful matmul flops over (time x 91.75 TFLOPS peak)."""
        return self.flops / (self.total_us * 1e-6 * PEAK_FLOPS) if self.total_us else 0.0

    def __add__(self, other: "ModeledTime") -> "ModeledTime":
        """Kernels called one after another."""
        eng = {k: self.engines_us.get(k, 0.0) + other.engines_us.get(k, 0.0)
               for k in set(self.engines_us) | set(other.engines_us)}
        return ModeledTime(self.total_us + other.total_us, eng, self.hbm_bytes + other.hbm_bytes,
                           self.flops + other.flops, max(self.peak_sbuf_bytes, other.peak_sbuf_bytes),
                           max(self.peak_psum_banks, other.peak_psum_banks),
                           self.num_instructions + other.num_instructions, self.num_kernels + other.num_kernels)

    def as_dict(self) -> dict:
        """JSON-friendly summary."""
        return {"modeled_us": round(self.total_us, 3), "bound": self.bound,
                "engines_us": {k: round(v, 3) for k, v in sorted(self.engines_us.items())},
                "hbm_bytes": self.hbm_bytes, "flops": self.flops,
                "pe_utilisation": round(self.pe_utilisation, 4), "peak_sbuf_bytes": self.peak_sbuf_bytes,
                "peak_psum_banks": self.peak_psum_banks, "num_kernels": self.num_kernels}


def _instr_seconds(i) -> tuple[str, float]:
    if i.engine == "pe":
        cycles = max(min(MIN_II, i.stat_free), i.free) * (4 if i.fp32 else 1)
        return "pe", cycles / (PE_HZ * PE_EFFICIENCY)
    if i.engine == "dma":
        return "dma", i.nbytes / dma_bandwidth(i.contig)
    hz = {"act": ACT_HZ, "dve": DVE_HZ, "pool": POOL_HZ}[i.engine]
    return i.engine, (max(MIN_II, i.free) + INSTR_OVERHEAD) / hz


def model_trace(trace: Trace) -> ModeledTime:
    """Modeled time of a traced kernel: max over engine busy times plus DMA latency at both ends."""
    busy = {"pe": 0.0, "act": 0.0, "dve": 0.0, "pool": 0.0, "dma": 0.0, "psum_port": 0.0}
    for i in trace.instrs:
        eng, sec = _instr_seconds(i)
        busy[eng] += sec * i.count
        if i.psum and eng in ("act", "dve"):
            busy["psum_port"] += sec * i.count
    total = max(busy.values()) + 2 * DMA_LATENCY_S
    return ModeledTime(total * 1e6, {k: v * 1e6 for k, v in busy.items()}, trace.hbm_bytes, trace.matmul_flops,
                       trace.peak_sbuf_bytes, trace.peak_psum_banks, sum(i.count for i in trace.instrs))


def model_kernel(kernel, *shapes, dtype=BF16, **kwargs) -> ModeledTime:
    """Modeled time of kernel(*inputs of these shapes, **kwargs), from a trace-only emulator run."""
    specs = [TensorSpec(tuple(s), np.dtype(dtype)) for s in shapes]
    _, trace = run(kernel, *specs, trace_only=True, **kwargs)
    return model_trace(trace)


def _ranks(ranks) -> tuple[int, int, int]:
    out = (ranks,) * 3 if isinstance(ranks, int) else tuple(int(r) for r in ranks)
    if len(out) != 3 or any(r <= 0 or r % 128 for r in out):
        raise ValueError(f"ranks must be positive multiples of 128 (one int or gate, up, down), got {ranks!r}")
    return out


def model_dense_matmul(num_tokens: int, d_in: int, d_out: int, tiles: dict | None = None) -> ModeledTime:
    """Modeled time of dense_matmul for x [num_tokens, d_in] · w [d_in, d_out]; tiles default to the selector's."""
    from .kernels.dense_matmul import dense_matmul
    from .tiling import select_tiles

    tiles = tiles if tiles is not None else select_tiles("dense_matmul", num_tokens, d_in, d_out)
    return model_kernel(dense_matmul, (num_tokens, d_in), (d_in, d_out), **tiles)


def model_lowrank_matmul(num_tokens: int, d_in: int, rank: int, d_out: int, tiles: dict | None = None,
                         transpose_out: bool = False, transpose_in: bool = False) -> ModeledTime:
    """Modeled time of the fused lowrank_matmul x · u [d_in, rank] · v [rank, d_out].

    transpose_in: x arrives feature-major (xᵀ [d_in, num_tokens]); given tiles say so themselves
    (their transpose_in key), which overrides this flag.
    """
    from .kernels.lowrank_matmul import lowrank_matmul
    from .tiling import select_tiles

    _ranks(rank)
    if tiles is None:
        tiles = select_tiles("lowrank_matmul", num_tokens, d_in, rank, d_out, transpose_out=transpose_out,
                             transpose_in=transpose_in)
    tiles = {"transpose_in": transpose_in, **tiles}
    x_shape = (d_in, num_tokens) if tiles["transpose_in"] else (num_tokens, d_in)
    return model_kernel(lowrank_matmul, x_shape, (d_in, rank), (rank, d_out), transpose_out=transpose_out, **tiles)


def model_lowrank_mlp(num_tokens: int, hidden: int, intermediate: int, ranks, tiles: dict | None = None
                      ) -> ModeledTime:
    """Modeled time of the fused lowrank_mlp; ranks is one int or (r_gate, r_up, r_down), multiples of 128.

    Example: model_lowrank_mlp(128, 2048, 8192, 1280).total_us -> microseconds on one trn1 NeuronCore.
    """
    from .kernels.lowrank_mlp import lowrank_mlp
    from .tiling import select_tiles

    rg, ru, rd = _ranks(ranks)
    tiles = tiles if tiles is not None else select_tiles("lowrank_mlp", num_tokens, hidden, intermediate,
                                                         (rg, ru, rd))
    h, i = hidden, intermediate
    return model_kernel(lowrank_mlp, (num_tokens, h), (h, rg), (rg, i), (h, ru), (ru, i), (i, rd), (rd, h), **tiles)


def model_swiglu(num_tokens: int, intermediate: int, feature_major: bool = False) -> ModeledTime:
    """Modeled time of the standalone SwiGLU elementwise kernel over HBM tensors.

    feature_major: g, u, h are [intermediate, num_tokens]; rows shorter than 4 KiB are packed
    (row_pack adjacent rows per partition): the fewest that make a 4 KiB run, among the divisors of
    intermediate / 128 up to 32 (e.g. 19 for Qwen3-4B's 9728 at 128 tokens).
    """
    from .kernels.swiglu import swiglu

    if not feature_major:
        return model_kernel(swiglu, (num_tokens, intermediate), (num_tokens, intermediate))
    tiles = intermediate // 128 if intermediate % 128 == 0 else 1
    packs = [p for p in range(1, 33) if tiles % p == 0]
    row = min(num_tokens, 2048) * 2  # bytes of one row per column block (swiglu's col_block)
    pack = next((p for p in packs if p * row >= 4096), packs[-1])
    return model_kernel(swiglu, (intermediate, num_tokens), (intermediate, num_tokens), row_pack=pack)


# fused_matmul_fm: the fused_matmul chain with feature-major activations between the kernels (gate/up
# store Yᵀ, SwiGLU runs on [intermediate, tokens], down reads it as Xᵀ: no on-chip transposes in down).
MLP_VARIANTS = ("dense", "two_matmuls", "fused_matmul", "fused_matmul_fm", "fused_mlp")


def model_mlp(variant: str, num_tokens: int, hidden: int, intermediate: int, ranks) -> ModeledTime:
    """Modeled time of a whole SwiGLU MLP computed one of five ways (summing sequential kernel calls).

    dense: dense_matmul for gate, up, down + swiglu; two_matmuls: each low-rank projection as two
    dense_matmul calls through HBM + swiglu; fused_matmul: lowrank_matmul per projection + swiglu;
    fused_matmul_fm: the same with feature-major activations between the kernels (gate/up with
    transpose_out, SwiGLU on [intermediate, tokens], down with transpose_in; x and y token-major);
    fused_mlp: one lowrank_mlp call.
    """
    rg, ru, rd = _ranks(ranks)
    t, h, i = num_tokens, hidden, intermediate
    if variant == "dense":
        return (model_dense_matmul(t, h, i) + model_dense_matmul(t, h, i) + model_swiglu(t, i)
                + model_dense_matmul(t, i, h))
    if variant == "two_matmuls":
        parts = [model_dense_matmul(t, a, r) + model_dense_matmul(t, r, b) for a, r, b in
                 ((h, rg, i), (h, ru, i), (i, rd, h))]
        return parts[0] + parts[1] + model_swiglu(t, i) + parts[2]
    if variant == "fused_matmul":
        return (model_lowrank_matmul(t, h, rg, i) + model_lowrank_matmul(t, h, ru, i) + model_swiglu(t, i)
                + model_lowrank_matmul(t, i, rd, h))
    if variant == "fused_matmul_fm":
        return (model_lowrank_matmul(t, h, rg, i, transpose_out=True)
                + model_lowrank_matmul(t, h, ru, i, transpose_out=True) + model_swiglu(t, i, feature_major=True)
                + model_lowrank_matmul(t, i, rd, h, transpose_in=True))
    if variant == "fused_mlp":
        return model_lowrank_mlp(t, h, i, (rg, ru, rd))
    raise ValueError(f"unknown MLP variant {variant!r}; expected one of {MLP_VARIANTS}")


def calibration() -> dict:
    """Model the four AWS tutorial schedules at the tutorial's shape -> {name: (modeled_ms, published_ms)}."""
    from .kernels.tutorial_matmul import SCHEDULES

    k, m, n = TUTORIAL_SHAPE["K"], TUTORIAL_SHAPE["M"], TUTORIAL_SHAPE["N"]
    return {name: (model_kernel(kern, (k, m), (k, n)).total_us / 1e3, TUTORIAL_MS[name])
            for name, kern in SCHEDULES.items()}
