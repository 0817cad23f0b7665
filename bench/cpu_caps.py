"""Run a command with every library capped at an older instruction set: another CPU class's code paths, here.

No session has had an AVX2-only CPU, so its code paths are measured on an AVX-512 machine with each library told
to stop at AVX2. Every library must be told: a library left uncapped runs its AVX-512 kernels and flatters the
result (MKL, which serves torch's fp32 matmul and bmm, ran at AVX-512 rates when only oneDNN was capped).

    python -m bench.cpu_caps avx2 python -m bench.serve --systems neuronmm ...
    python -m bench.cpu_caps avx512 python -m bench.serve ...        # AVX-512 without native bf16 (Ice Lake Xeons)
    python -m bench.cpu_caps avx512-bf16 python -m bench.serve ...   # AVX512-BF16 without AMX (the AMD EPYC class)

The memory system stays this machine's, so the numbers are a proxy for such a CPU, not a measurement of one.
Benchmarks record the caps in force (`caps_in_force`) beside the CPU flags.
"""

from __future__ import annotations

import os
import sys

# What each cap sets: our fused ops' -march, ATen's kernels, oneDNN's and MKL's dispatch; for a CPU with
# AVX512-BF16 but no AMX, our bf16 GEMMs' AMX threshold (gemm_tuning) and oneDNN's ISA. Under `avx2` and `avx512`
# the -march has no native bf16, so `dtype: auto` serves fp32 there, as on such a CPU.
CAPS = {
    "avx2": {
        "NEURONMM_CPU_ARCH": "x86-64-v3",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "avx512": {  # Skylake-SP to Ice Lake Xeons: AVX-512 (VNNI from Cascade Lake on), no AVX512-BF16, no AMX
        "NEURONMM_CPU_ARCH": "icelake-server",
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512_E2",
    },
    "avx512-bf16": {
        "NEURONMM_BF16_AMX_ROWS": "0",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    },
}
CAP_VARIABLES = sorted({name for env in CAPS.values() for name in env})


def caps_in_force() -> dict[str, str]:
    """The instruction-set caps this process runs under (empty: every library at the CPU's best)."""
    return {name: os.environ[name] for name in CAP_VARIABLES if name in os.environ}


USAGE = f"usage: python -m bench.cpu_caps {{{','.join(CAPS)}}} COMMAND [ARG...]"


def main(argv: list[str] | None = None) -> int:
    """CLI entry: `cpu_caps CAP COMMAND...` replaces this process with COMMAND under CAP's environment.

    Not argparse: everything after CAP is the command's own, its flags included. Exit codes as a shell's: 2 for a
    bad usage, 127 for a command not found, 126 for one that cannot be run."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(f"{USAGE}\n\n{__doc__.strip()}")
        return 0
    if len(argv) < 2 or argv[0] not in CAPS:
        print(USAGE, file=sys.stderr)
        return 2
    try:
        os.execvpe(argv[1], argv[1:], {**os.environ, **CAPS[argv[0]]})
    except FileNotFoundError:
        print(f"bench.cpu_caps: error: {argv[1]}: command not found", file=sys.stderr)
        return 127
    except OSError as exc:  # a folder, no execute permission, a bad executable
        print(f"bench.cpu_caps: error: {argv[1]}: cannot run it ({exc.strerror or exc})", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main())
