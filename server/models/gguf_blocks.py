"""A GGUF's own quantised blocks as weights (`--quantization gguf`): read, matched to the model's weights, packed.

llama.cpp's Q4_1 and Q8_0 tensors hold each row's weights per 32 inputs as codes q with an f16 scale d (and, Q4_1,
an f16 offset m); they decode to w = d·q + m in fp32, and that is what the converted model holds. The block panels
(csrc/small_gemm.cpp, "GGUF blocks") decode them inside the fp32 GEMM: the same weights, bit for bit, from a third
of the bytes. Each weight of the model is matched to the GGUF rows it came from by its values (a fused QKV is three
tensors' rows, llama.cpp's Q and K rows are in its own order), and a weight is taken only where every row matches
exactly; the others stay fp32.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

BLOCK = 32  # inputs a block (both formats)
PANEL = 32  # output columns a panel
KINDS = (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0)  # the block formats read


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
    blocks = raw.reshape(raw.shape[0], K // BLOCK, GGML_QUANT_SIZES[kind][1])
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


# GGUF metadata value types: fixed sizes by type id (8 = string, 9 = array)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


class _Cursor:
    """Little-endian reads through a GGUF's header."""

    def __init__(self, buf: mmap.mmap):
        self.buf, self.at = buf, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values if len(values) > 1 else values[0]

    def string(self) -> bytes:
        n = self.take("Q")
        self.at += n
        return bytes(self.buf[self.at - n:self.at])

    def skip_value(self, kind: int) -> None:
        if kind == 8:
            n = self.take("Q")  # (not `self.at += self.take(...)`: that adds to the position before the read)
            self.at += n
        elif kind == 9:
            item, count = self.take("IQ")
            if item in _SCALAR_BYTES:
                self.at += count * _SCALAR_BYTES[item]
            else:
                for _ in range(count):
                    self.skip_value(item)
        else:
            self.at += _SCALAR_BYTES[kind]


def _tensors(buf: mmap.mmap) -> Iterator[tuple[GGMLQuantizationType, tuple[int, ...], int]]:
    """(type, shape as GGUF states it, data offset) of each tensor. gguf-py's reader also parses every metadata
    field (the vocabulary's ~100,000 strings: seconds); this walks past them."""
    cur = _Cursor(buf)
    magic, version, n_tensors, n_fields = cur.take("4sIQQ")
    if magic != b"GGUF" or version < 2:
        raise ValueError("not a GGUF (version 2 or later) file")
    alignment = 32
    for _ in range(n_fields):
        key, kind = cur.string(), cur.take("I")
        if key == b"general.alignment" and kind == 4:
            alignment = cur.take("I")
        else:
            cur.skip_value(kind)
    infos = []
    for _ in range(n_tensors):
        cur.string()
        dims = cur.take("I")
        shape = tuple(cur.take("Q") for _ in range(dims))
        kind, offset = cur.take("IQ")
        infos.append((kind, shape, offset))
    start = -(-cur.at // alignment) * alignment
    for kind, shape, offset in infos:
        yield GGMLQuantizationType(kind), shape, start + offset


def read_blocks(path: Path) -> dict[int, BlockRows]:
    """Every Q4_1 / Q8_0 row of a GGUF, grouped by width K (ValueError: a file that is not a whole GGUF)."""
    try:
        return _read_blocks(path)
    except (struct.error, ValueError) as exc:
        raise ValueError(f"{path.name} is not a readable GGUF ({exc})") from None


def _read_blocks(path: Path) -> dict[int, BlockRows]:
    groups: dict[int, list[BlockRows]] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        for kind, shape, offset in _tensors(buf):
            if kind not in KINDS:
                continue
            K, rows = shape[0], int(np.prod(shape[1:]))
            block_size, block_bytes = GGML_QUANT_SIZES[kind]
            raw = np.frombuffer(buf, np.uint8, rows * K // block_size * block_bytes, offset).reshape(rows, -1)
            groups.setdefault(K, []).append(parse_blocks(kind, raw, K))
            del raw  # (no view of the map may outlive it)
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
