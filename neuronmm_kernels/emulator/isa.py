"""The `nisa` (neuronxcc.nki.isa) subset our kernels use: nc_matmul, nc_transpose, activation, copies."""

from __future__ import annotations

from . import core, language as nl
from .core import PSUM, SBUF, Instr, NKIRuleError, Tensor, check_tile, ctx

unknown_engine, tensor_engine, vector_engine, scalar_engine, gpsimd_engine = range(5)
_ENGINE = {unknown_engine: "dve", vector_engine: "dve", scalar_engine: "act", gpsimd_engine: "pool"}


def nc_matmul(stationary: Tensor, moving: Tensor, *, is_stationary_onezero=False, is_moving_onezero=False,
              is_transpose=False, tile_position=(), tile_size=(), mask=None, **_) -> Tensor:
    """stationary.T @ moving on TensorE: [K, M] x [K, N] -> new PSUM tile [M, N] (fp32)."""
    nl._no_mask(mask)
    for name, t in (("stationary", stationary), ("moving", moving)):
        check_tile(t, f"nc_matmul {name}")
        if t.buffer is not SBUF:
            raise NKIRuleError("matmul_operands_in_sbuf", f"nc_matmul {name} must be in SBUF, got {t}")
        if t.ndim != 2:
            raise NKIRuleError("matmul_operand_2d", f"nc_matmul {name} must be 2-D, got {t.shape}")
    (k, m), (k2, n) = stationary.shape, moving.shape
    if k != k2:
        raise NKIRuleError("matmul_contraction_partitions",
                           f"stationary has {k} partitions, moving {k2}: contraction dims must match")
    if m > core.GEMM_STATIONARY_FMAX:
        raise NKIRuleError("matmul_stationary_free_le_128", f"stationary free size {m} > 128")
    if n > core.GEMM_MOVING_FMAX:
        raise NKIRuleError("matmul_moving_free_le_512", f"moving free size {n} > 512")
    fp32 = [t.dtype == core.float32 for t in (stationary, moving)]
    if fp32[0] != fp32[1]:
        raise NKIRuleError("matmul_dtype_mix", f"fp32 operand with a {moving.dtype if fp32[0] else stationary.dtype}"
                           " operand")
    instr = ctx().record(Instr("pe", "transpose" if is_transpose else "matmul", parts=k, free=n, stat_free=m,
                               fp32=fp32[0], flops=0 if is_transpose else 2 * k * m * n))
    out = nl._new((m, n), core.float32, PSUM, fresh=instr)
    s, mv = stationary.read(), moving.read()
    out.write(None if s is None else s.T @ mv)
    return out


def nc_transpose(data: Tensor, *, mask=None, dtype=None, engine=unknown_engine, **_) -> Tensor:
    """Swap partition and free axes: on TensorE (<= 128 x 128, result in PSUM fp32) or VectorE (<= 32 x 32)."""
    nl._no_mask(mask)
    check_tile(data, "nc_transpose")
    if data.ndim != 2:
        raise NKIRuleError("err_exceed_max_supported_dimension", f"nc_transpose takes 2-D tiles, got {data.shape}")
    p, f = data.shape
    if engine == vector_engine:
        if p > 32 or f > 32:
            raise NKIRuleError("transpose_vector_32", f"VectorE transpose is limited to 32x32, got {data.shape}")
        instr = ctx().record(Instr("dve", "transpose", parts=p, free=f, psum=data.buffer is PSUM))
        out = nl._new((f, p), dtype or data.dtype, SBUF, fresh=instr)
    else:
        if data.buffer is not SBUF:
            raise NKIRuleError("matmul_operands_in_sbuf", f"TensorE transpose reads SBUF, got {data}")
        if data.dtype == core.float32:  # compiles, but the result is wrong on trn1: refuse it here
            raise NKIRuleError("pe_transpose_fp32_inexact",
                               "nc_transpose of fp32 data on TensorE is not exact on trn1; use nc_matmul against an "
                               "fp32 identity (nki-samples 8370e11^ flash_paged_attn_varlen/utils.py:311-327)")
        if f > core.PMAX:
            raise NKIRuleError("err_size_of_dimension_exceed_arch_limit", f"PE transpose of {data.shape} > 128x128")
        instr = ctx().record(Instr("pe", "transpose", parts=p, free=p, stat_free=f))
        out = nl._new((f, p), core.float32, PSUM, fresh=instr)
    v = data.read()
    out.write(None if v is None else v.T)
    return out


def activation(op, data: Tensor, *, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=None,
               mask=None, dtype=None, **_) -> Tensor:
    """op(data * scale + bias) on ScalarE in fp32, cast to dtype (default data.dtype); reads SBUF or PSUM."""
    check_tile(data, "activation")
    rect = nl._mask_rect(mask, data.shape)
    fn = getattr(op, "_np", None)
    if fn is None:
        raise NKIRuleError("err_activation_op", f"unsupported activation function {op!r}")
    for name, vec, types_ in (("bias", bias, (core.float32, core.bfloat16, core.float16)),
                              ("scale", scale, (core.float32,))):
        if isinstance(vec, Tensor):
            check_tile(vec, f"activation {name}")
            if vec.shape != (data.shape[0], 1) or vec.dtype not in types_:
                raise NKIRuleError(f"err_activation_{name}_invalid_type",
                                   f"activation {name} must be a [P, 1] {types_} vector, got {vec.shape} {vec.dtype}")
    if reduce_op is not None or reduce_res is not None:
        raise NKIRuleError("emulator_unsupported", "activation reductions are not emulated")
    instr = ctx().record(Instr("act", "activation", parts=data.shape[0], free=data.free_size(),
                               psum=data.buffer is PSUM))
    out = nl._new(data.shape, dtype or data.dtype, SBUF, fresh=instr)
    v = data.read()
    if v is not None:
        s = scale.read() if isinstance(scale, Tensor) else scale
        b = bias.read() if isinstance(bias, Tensor) else (0.0 if bias is None else bias)
        nl._masked_write(out, fn(v * s + b), rect)
    return out


def tensor_copy(src: Tensor, *, mask=None, dtype=None, engine=unknown_engine, **_) -> Tensor:
    """Copy a tile (e.g. evict PSUM) on VectorE (default), ScalarE or GpSimd; returns a new SBUF tile."""
    check_tile(src, "tensor_copy")
    rect = nl._mask_rect(mask, src.shape)
    eng = _ENGINE.get(engine, "dve")
    if eng == "pool" and src.buffer is PSUM:
        raise NKIRuleError("err_unsupported_memory", "GpSimd cannot access PSUM")
    instr = ctx().record(Instr(eng, "tensor_copy", parts=src.shape[0], free=src.free_size(),
                               psum=src.buffer is PSUM))
    out = nl._new(src.shape, dtype or src.dtype, SBUF, fresh=instr)
    nl._masked_write(out, src.read(), rect)
    return out


def tensor_tensor(data1: Tensor, data2: Tensor, op, *, dtype=None, mask=None, engine=unknown_engine, **_) -> Tensor:
    """data1 op data2 elementwise on VectorE; op is nl.add, nl.multiply, ..."""
    name = getattr(op, "_binary", None)
    if name is None:
        raise NKIRuleError("err_tensor_tensor_op", f"unsupported tensor_tensor op {op!r}")
    if not (isinstance(data1, Tensor) and isinstance(data2, Tensor)):
        raise NKIRuleError("err_type", "tensor_tensor takes two tiles")
    return nl._binary(name, data1, data2, dtype=dtype, mask=mask)
