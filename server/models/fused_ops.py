"""The decode step's fused CPU ops (csrc/fused_ops.cpp), built once per machine, with torch references.

`load()` compiles the C++ source with the system compiler into the cache (keyed by the source, torch's
version and this CPU's flags, so a different machine gets its own build), loads it as `torch.ops.neuronmm`
and returns True; without a compiler it logs why and returns False, and the model runs the reference
functions below, which compute the same values with plain torch ops (also the CUDA path).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils import cpp_extension

from server.models.cpu_features import cpu_flags, target_arch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = (CSRC / "fused_ops.cpp", CSRC / "small_gemm.cpp", CSRC / "int8_gemm.cpp", CSRC / "decoder.cpp",
           CSRC / "work_split.cpp", CSRC / "prefill_attention.cpp", CSRC / "peak_rate.cpp")
HEADERS = (CSRC / "work_split.h", CSRC / "panel_parts.h", CSRC / "row_stores.h", CSRC / "step_ops.h",
           CSRC / "prefill_attention.h", CSRC / "vec8.h")
_loaded: bool | None = None
_library: Path | None = None


def cxxflags() -> list[str]:
    """The compiler flags: for this CPU, or for the -march that $NEURONMM_CPU_ARCH names (x86-64-v3 builds the
    AVX2 code paths, as a CPU without AVX-512 runs them). No FMA contraction: the reference rounds each product,
    and rotary must match it bit for bit."""
    return ["-O3", f"-march={target_arch()}", "-ffp-contract=off", "-fopenmp", "-fPIC", "-shared", "-std=c++17"]


def _build_dir(cache_dir: Path) -> Path:
    key = hashlib.sha256(b"".join(src.read_bytes() for src in SOURCES + HEADERS) + torch.__version__.encode()
                         + " ".join(cxxflags()).encode() + " ".join(sorted(cpu_flags())).encode()).hexdigest()[:16]
    return cache_dir / "ext" / f"fused_ops-{key}"


def _run(cmd: list[str], what: str) -> None:
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{what} failed: {result.stderr.strip()[-2000:]}")


def _compile(target: Path) -> None:
    """Compile SOURCES into `target` (written under a temporary name, then renamed: never half a library). Each
    source is its own compiler process, as many at once as there are CPUs: a first start waits ~27 s on 2 cores where
    one process took ~53 s."""
    cxx = os.environ.get("CXX", "g++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx}) on PATH")
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    libs = [f"-L{p}" for p in cpp_extension.library_paths()] + ["-lc10", "-ltorch_cpu"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    flags = [flag for flag in cxxflags() if flag != "-shared"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{src.stem}.o" for src in SOURCES]
        # the longest first, so the last one to start is a short one
        jobs = sorted(zip(SOURCES, objects), key=lambda job: -job[0].stat().st_size)
        with ThreadPoolExecutor(max_workers=max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
            list(pool.map(lambda job: _run([cxx, *flags, abi, *includes, "-c", str(job[0]), "-o", str(job[1])],
                                           f"compiling {job[0].name}"), jobs))
        out = Path(tmp) / target.name
        _run([cxx, *cxxflags(), *map(str, objects), "-o", str(out), *libs], f"linking {target.name}")
        os.replace(out, target)


def load(cache_dir: Path | None = None) -> bool:
    """Make torch.ops.neuronmm available (building it if needed); False when it cannot be built here."""
    global _loaded, _library
    if _loaded is not None:
        return _loaded
    cache_dir = cache_dir or Path(os.environ.get("NEURONMM_CACHE_DIR", "~/.cache/neuronmm")).expanduser()
    target = _build_dir(cache_dir) / "fused_ops.so"
    try:
        if not target.is_file():
            log.info("building the fused CPU ops for -march=%s (once per machine, ~30 s on 2 cores)",
                     cxxflags()[1].split("=")[1])
            _compile(target)
        torch.ops.load_library(str(target))
        _loaded, _library = True, target
    except (RuntimeError, OSError) as exc:
        log.warning("fused CPU ops unavailable, using the torch reference path: %s", str(exc).splitlines()[0])
        _loaded = False
    return _loaded


def library_dir() -> Path | None:
    """The folder of the library load() loaded: one a build of the sources for one CPU (None before, or without it)."""
    return _library.parent if _library is not None else None


# ---- references: the same maths in plain torch (tests compare against these; CUDA runs them) --------

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF LlamaRMSNorm: normalise in fp32, round to x's dtype, multiply by the weight in that dtype."""
    xf = x.float()
    return weight.to(x.dtype) * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x += y in place (the residual), then rms_norm_ref of the new x."""
    x.add_(y)
    return rms_norm_ref(x, weight, eps)


def head_rms_norm_ref(qkv: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, num_q_heads: int,
                      num_kv_heads: int, eps: float) -> torch.Tensor:
    """Qwen3's per-head norms in place: qkv's query heads rms_norm_ref'ed with q_weight, its key heads with k_weight."""
    head_dim = q_weight.shape[0]
    q_width, k_width = num_q_heads * head_dim, num_kv_heads * head_dim
    for weight, span in ((q_weight, slice(0, q_width)), (k_weight, slice(q_width, q_width + k_width))):
        qkv[:, span] = rms_norm_ref(qkv[:, span].reshape(-1, head_dim), weight, eps).view(qkv.shape[0], -1)
    return qkv


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [num_tokens, 2 * inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF rotary: x * cos + rotate_half(x) * sin, for x [num_tokens, heads, head_dim], tables [num_tokens, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos.unsqueeze(1) + rotated * sin.unsqueeze(1)


_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def as_cache(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of `cache_dtype` stores it: rounded; fp8 e4m3fn saturated at +-448, as the fused op's store does
    (explicitly, rather than resting on what this torch version's cast does past 448)."""
    if cache_dtype == torch.float8_e4m3fn:
        x = x.clamp(-_FP8_MAX, _FP8_MAX)
    return x.to(cache_dtype)


def attention_ref(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                  seq_index: torch.Tensor, context_lens: torch.Tensor, num_heads: int, num_kv_heads: int,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What torch.ops.neuronmm.attention computes: rotary, cache write, attention per token; (out, q_rot)."""
    num_tokens = qkv.shape[0]
    head_dim = k_cache.shape[-1]
    block_size = k_cache.shape[2]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = rotate_ref(q.reshape(num_tokens, num_heads, head_dim), cos, sin)
    k = rotate_ref(k.reshape(num_tokens, num_kv_heads, head_dim), cos, sin)
    # the cache may be narrower than the model (fp16 / bf16 under fp32, fp8): stored rounded, read back widened
    k_cache[slot_mapping // block_size, :, slot_mapping % block_size] = as_cache(k, k_cache.dtype)
    v_cache[slot_mapping // block_size, :, slot_mapping % block_size] = as_cache(
        v.reshape(num_tokens, num_kv_heads, head_dim), v_cache.dtype)
    # every token against as many positions as the widest block table holds, keys past its own context masked out
    # (the table's width rather than the longest context: no device-to-host sync, and a static shape to capture)
    max_len = block_tables.shape[1] * block_size
    if not qkv.is_cuda:  # on the CPU the longest context costs no sync: no further (a slot cache's one block is long)
        max_len = max(min(max_len, int(context_lens.max())), 1)
    positions = torch.arange(max_len, device=qkv.device)
    blocks = block_tables[seq_index.long()][:, positions // block_size].long()  # [num_tokens, max_len]
    keys = k_cache[blocks, :, positions % block_size].transpose(1, 2).to(q.dtype)  # [num_tokens, Hkv, max_len, D]
    values = v_cache[blocks, :, positions % block_size].transpose(1, 2).to(q.dtype)
    mask = (positions < context_lens.unsqueeze(1)) | (context_lens.unsqueeze(1) == 0)  # no all-masked rows
    # positions past a token's context may never have been written (NaN garbage in an empty cache), and a
    # masked score still multiplies its value: zero them rather than trust the mask
    written = (positions < context_lens.unsqueeze(1)).view(num_tokens, 1, -1, 1)
    keys, values = keys.where(written, 0), values.where(written, 0)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask.view(num_tokens, 1, 1, -1),
                                         scale=scale, enable_gqa=True).squeeze(2)
    out = out.masked_fill((context_lens == 0).view(-1, 1, 1), 0)
    return out.reshape(num_tokens, num_heads * head_dim), q


@dataclass(frozen=True)
class Kernels:
    """The decode step's small ops, one implementation set (fused C++ or torch reference)."""

    rms_norm: Callable
    add_rms_norm: Callable
    silu_mul: Callable
    attention: Callable
    head_rms_norm_: Callable  # Qwen3's per-head q/k norms, in place on qkv
    # Prefill chunks at least this long are attended by SDPA (a GEMM over the chunk) instead of token by
    # token; None: never. The torch reference attends token by token through a padded gather, so SDPA wins
    # early. The fused CPU op attends a short chunk faster than CPU SDPA (whose flash kernel costs ~290 us a layer
    # for a 128-token chunk, after gathering the keys out of the paged cache); see kernels_for for long ones.
    sdpa_min_chunk: int | None = 32
    # All layers of a step in one call (csrc/decoder.cpp), for a model whose projections are all panel GEMMs;
    # None: the layers run through the ops above, from Python.
    decode_layers: Callable | None = None


REFERENCE_KERNELS = Kernels(rms_norm_ref, add_rms_norm_ref, silu_mul_ref, attention_ref, head_rms_norm_ref)


# A bf16 model's prefill chunks from this long go to SDPA under the fused ops: torch's bf16 flash kernel runs its
# GEMMs on the CPU's bf16 units, and from 512-token chunks it beats the fused op's token-by-token attention (a
# 1,024-token prompt 470 -> 340 ms, 512 tokens 160 -> 135 ms, 256 level, 128 slower: 40 -> 47 ms; AMX machine). An
# fp32 model keeps the fused op at every length (AVX2 build, 512 / 1,024 tokens: SDPA level or slower).
_BF16_SDPA_MIN_CHUNK = 256


def kernels_for(device: torch.device, dtype: torch.dtype | None = None) -> Kernels:
    """The fused CPU ops on a CPU that can build them (long bf16 prefill chunks through SDPA), else the torch
    references."""
    if device.type != "cpu" or not load():
        return REFERENCE_KERNELS
    ops = torch.ops.neuronmm
    # the overloads, resolved once (calling the packet resolves one per call, ~1 µs)
    return Kernels(ops.rms_norm.default, ops.add_rms_norm.default, ops.silu_mul.default, ops.attention.default,
                   ops.head_rms_norm_.default, sdpa_min_chunk=_BF16_SDPA_MIN_CHUNK if dtype == torch.bfloat16 else None,
                   decode_layers=ops.decode_layers.default)
