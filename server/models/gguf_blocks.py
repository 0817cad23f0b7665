"""A GGUF's own quantised blocks as weights (`--quantization gguf`): read, matched to the model's weights, packed.

llama.cpp's Q4_1 and Q8_0 tensors hold each row's weights per 32 inputs as codes q with an f16 scale d (and, Q4_1,
an f16 offset m); they decode to w = d·q + m in fp32, and that is what the converted model holds. The block panels
(csrc/small_gemm.cpp, "GGUF blocks") decode them inside the fp32 GEMM: the same weights, bit for bit, from a third
of the bytes. Each weight of the model is matched to the GGUF rows it came from by its values (a fused QKV is three
tensors' rows, llama.cpp's Q and K rows are in its own order), and a weight is taken only where every row matches
exactly; the others stay fp32.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader

log = logging.getLogger(__name__)

BLOCK = 32  # inputs a block (both formats)
PANEL = 32  # output columns a panel
_BLOCK_BYTES = {GGMLQuantizationType.Q4_1: 20, GGMLQuantizationType.Q8_0: 34}


@dataclass
class BlockRows:
    """Rows of quantised weights of one width K: codes [R, K] int8, scales d and offsets m [R, K / 32] fp32."""

    codes: np.ndarray
    d: np.ndarray
    m: np.ndarray

    def decoded(self, rows: np.ndarray | slice = slice(None)) -> np.ndarray:
        """Rows as fp32 weights, as gguf-py (and so the converted model) decodes them: d·q exact, + m rounded."""
        codes, d, m = self.codes[rows], self.d[rows], self.m[rows]
        R, K = codes.shape
        q = codes.reshape(R, K // BLOCK, BLOCK).astype(np.float32)
        return (d[..., None] * q + m[..., None]).reshape(R, K)


def parse_blocks(kind: GGMLQuantizationType, raw: np.ndarray, K: int) -> BlockRows:
    """A tensor's raw rows [R, K / 32 · block bytes] (uint8) as codes, scales and offsets."""
    blocks = raw.reshape(raw.shape[0], K // BLOCK, _BLOCK_BYTES[kind])
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == GGMLQuantizationType.Q4_1:
        m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        packed = blocks[..., 4:]
        codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int8)  # q[j], q[j + 16]
    else:
        # -0.0: d·q + (-0.0) is d·q with its sign, where + 0.0 would turn a -0.0 weight into +0.0
        m = np.full_like(d, -0.0)
        codes = blocks[..., 2:].copy().view(np.int8)
    return BlockRows(codes.reshape(raw.shape[0], K), d, m)


def read_blocks(path: Path) -> dict[int, BlockRows]:
    """Every Q4_1 / Q8_0 row of a GGUF, grouped by width K."""
    groups: dict[int, list[BlockRows]] = {}
    for tensor in GGUFReader(path).tensors:
        if tensor.tensor_type not in _BLOCK_BYTES:
            continue
        K = int(tensor.shape[0])
        raw = np.asarray(tensor.data).reshape(-1, K // BLOCK * _BLOCK_BYTES[tensor.tensor_type])
        groups.setdefault(K, []).append(parse_blocks(tensor.tensor_type, raw, K))
    return {K: BlockRows(*(np.concatenate([getattr(r, f) for r in rows]) for f in ("codes", "d", "m")))
            for K, rows in groups.items()}


def _row_keys(rows: np.ndarray, salt: np.ndarray) -> np.ndarray:
    """A 64-bit key per fp32 row from its bits (a wrapping dot product with random odd numbers)."""
    with np.errstate(over="ignore"):
        return rows.view(np.uint32).astype(np.uint64) @ salt


class GgufBlocks:
    """The block form of any model weight that a GGUF's quantised rows hold exactly (`find`)."""

    def __init__(self, rows_by_width: dict[int, BlockRows], seed: int = 0):
        self._rows = rows_by_width
        self._index: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}  # K -> salt, sorted keys, their rows
        self._seed = seed

    @classmethod
    def read(cls, path: Path) -> GgufBlocks:
        """The quantised rows of the GGUF at `path`."""
        return cls(read_blocks(path))

    @property
    def empty(self) -> bool:
        """Whether the GGUF holds no Q4_1 / Q8_0 rows at all."""
        return not self._rows

    def _indexed(self, K: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(salt, sorted keys, the rows they belong to) of the rows of width K, made on first use."""
        if K not in self._index:
            rows = self._rows[K]
            salt = np.random.default_rng(self._seed).integers(1, 2**63, size=K, dtype=np.uint64) | 1
            step = 4096  # rows decoded at a time: the index keeps keys, not a decoded copy of the file
            keys = np.concatenate([_row_keys(rows.decoded(slice(i, i + step)), salt)
                                   for i in range(0, len(rows.codes), step)])
            order = np.argsort(keys, kind="stable")
            self._index[K] = (salt, keys[order], order)
        return self._index[K]

    def find(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes [N, K] int8, d and m [N, K / 32] fp32) whose decoding is `weight` [N, K] (fp32) bit for bit, or
        None where a row has no exact match."""
        if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] not in self._rows:
            return None
        salt, keys, order = self._indexed(weight.shape[1])
        source = self._rows[weight.shape[1]]
        w = weight.detach().contiguous().numpy()
        wanted = _row_keys(w, salt)
        at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        rows = order[at]
        if not (keys[at] == wanted).all() or not (source.decoded(rows).view(np.uint32) == w.view(np.uint32)).all():
            return None
        return tuple(torch.from_numpy(np.ascontiguousarray(a[rows])) for a in (source.codes, source.d, source.m))


def pack_block_panels(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(codes [N, K] int8, d, m [N, K / 32] fp32) -> block panels [ceil(N / 32), K / 32, 1280] int8 for
    csrc/small_gemm.cpp: per panel and block, the 32 columns' scales, their offsets, then 32 inputs' 32 codes each
    (zero columns pad N)."""
    N, K = codes.shape
    if K % BLOCK:
        raise ValueError(f"GGUF block panels need in_features a multiple of {BLOCK}, got {K}")
    panels, blocks = (N + PANEL - 1) // PANEL, K // BLOCK
    pad = panels * PANEL - N

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(pad, t.shape[1])]) if pad else t

    codes_p = padded(codes).reshape(panels, PANEL, blocks, BLOCK).permute(0, 2, 3, 1)  # [P, B, k, column]
    scales = [padded(t.float()).reshape(panels, PANEL, blocks).permute(0, 2, 1).contiguous().view(torch.int8)
              for t in (d, m)]
    return torch.cat([*scales, codes_p.reshape(panels, blocks, BLOCK * PANEL)], 2).contiguous()


def decode_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """The fp32 weight [N, K] that (codes, d, m) decode to (d·q exact, then + m rounded once)."""
    N, K = codes.shape
    q = codes.reshape(N, K // BLOCK, BLOCK).float()
    return (d[..., None] * q + m[..., None]).reshape(N, K)
