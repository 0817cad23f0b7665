"""The arithmetic peak of this machine's vector units on every thread: the compute floor beside the memory floor.

A step's FLOPs over this rate is the shortest time its GEMMs could take, as the bytes it reads (its weights and KV
cache) over the read bandwidth (bench.read_bandwidth) is the shortest time its stream could; the larger of the two is
the step's physical floor. A decode step of a few rows is bound by the stream, one of 16 rows of fp32 by the
arithmetic. The probe (csrc/peak_rate.cpp) runs independent chains of one instruction on registers on every thread:
fp32 FMAs, VDPBF16PS (AVX512-BF16) and VPDPBUSD (AVX512-VNNI), as this build has them (under bench.cpu_caps, the
capped ISA's).

    python -m bench.peak_rate
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from bench.harness import check_out, machine_facts, positive_int, publish, run_cli
from server.models import fused_ops
from server.models.cpu_features import cpu_flags

RESULTS = Path(__file__).parent / "results"
PROBE_SECONDS = 0.1  # a probe run: long enough that the region's fork is noise, short enough to run beside a benchmark
CHAINS = 12  # independent chains a thread runs (csrc/peak_rate.cpp)
OPS_PER_STEP = {"fp32_fma": 32, "bf16_dot": 64, "int8_dot": 128}  # a chain step's operations, as the probe counts


def peak_kinds() -> list[str]:
    """The instruction kinds this build can probe (empty where the fused CPU ops cannot be built)."""
    return list(torch.ops.neuronmm.peak_kinds()) if fused_ops.load() else []


def peak_rate(kind: str, repeats: int = 3) -> float:
    """Arithmetic operations per second of `kind` on every thread (a multiply-add counts two): the best of `repeats`
    runs of ~PROBE_SECONDS each, sized by a short first one."""
    probe = torch.ops.neuronmm.peak_rate
    first = probe(kind, 10**5)
    rounds = max(10**5, int(PROBE_SECONDS * first / (torch.get_num_threads() * CHAINS * OPS_PER_STEP[kind])))
    return max(probe(kind, rounds) for _ in range(repeats))


def gemm_kind(dtype: str, quantization: str | None, flags: frozenset[str] | None = None) -> str | None:
    """The probed instruction that bounds a model's GEMMs (None: none of the probed ones does).

    fp32 activations (fp32, bf16 or GGUF-block weights widened to fp32) multiply with fp32 FMAs, bf16 ones with
    VDPBF16PS (or fp32 FMAs: bounding_peak), int8 weights with VPDPBUSD. On a CPU with AMX the bf16 and int8 GEMMs can
    use its tiles, which are not probed."""
    flags = cpu_flags() if flags is None else flags
    if dtype == "float32":
        return "fp32_fma"
    if "amx_tile" in flags:
        return None
    if quantization == "int8":
        return "int8_dot" if "avx512_vnni" in flags else None
    if dtype == "bfloat16":
        return "bf16_dot" if "avx512_bf16" in flags else "fp32_fma"
    return None


def _candidates(kind: str) -> list[str]:
    """The probed kinds GEMMs of gemm_kind `kind` may run on: bf16 ones on VDPBF16PS or on fp32 FMAs, whichever the
    loader timed faster (server.models.gemm_tuning)."""
    return [kind, "fp32_fma"] if kind == "bf16_dot" else [kind]


def bounding_peak(kind: str | None, peaks: dict[str, float]) -> dict | None:
    """{"kind", "gops"}: of the measured `peaks` (kind -> G ops/s), the fastest that GEMMs of gemm_kind `kind` may run
    on (None: no kind, or none of its candidates measured)."""
    measured = {k: peaks[k] for k in _candidates(kind) if k in peaks} if kind else {}
    if not measured:
        return None
    best = max(measured, key=measured.get)
    return {"kind": best, "gops": measured[best]}


def runner_gemm_kind(runner) -> str | None:
    """gemm_kind of a loaded TorchRunner's model (None off the CPU, where nothing is probed)."""
    if runner.device.type != "cpu":
        return None
    return gemm_kind(str(runner.dtype).removeprefix("torch."), runner.quantization)


def gemm_peak(kind: str | None) -> dict | None:
    """{"kind", "gops"}: the rate that bounds GEMMs of gemm_kind `kind` on this machine, measured now (None: no kind,
    or none probed here)."""
    if not kind:
        return None
    available = peak_kinds()
    return bounding_peak(kind, {k: peak_rate(k) / 1e9 for k in _candidates(kind) if k in available})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.peak_rate", description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--out", default=str(RESULTS / "peak_rate.json"))
    args = p.parse_args(argv)
    out = check_out(args.out)
    kinds = peak_kinds()
    if not kinds:
        p.error("the probe needs the fused CPU ops (csrc/), which this machine cannot build")
    rows = [{"kind": k, "gops": peak_rate(k, args.repeats) / 1e9} for k in kinds]
    lines = [f"| instruction | G ops/s ({torch.get_num_threads()} threads) |", "|---|---:|"]
    lines += [f"| {row['kind']} | {row['gops']:.1f} |" for row in rows]
    report = {**machine_facts(), "torch_threads": torch.get_num_threads(), "rows": rows}
    return publish(out, report, "\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(run_cli(main))
