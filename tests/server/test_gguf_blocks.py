"""`quantization: gguf`: a GGUF's own Q4_1 / Q8_0 blocks, read, matched to the model's weights and multiplied in the
fp32 panel GEMM (csrc/small_gemm.cpp), which must give the fp32 panels' sums bit for bit."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from server.backends import check_backend_available, gguf_source
from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.config import ConfigError, load_config
from server.models import fused_ops
from server.models.gguf_blocks import BlockRows, GgufBlocks, decode_blocks, pack_block_panels, parse_blocks
from server.models.source import gguf_path

needs_ops = pytest.mark.skipif(not fused_ops.load() or not hasattr(torch.ops.neuronmm, "panel_linear_f32"),
                               reason="the fp32 panel GEMM is built for CPUs with AVX-512 or AVX2")


def _random_blocks(N: int, K: int, seed: int, signed: bool = False) -> tuple[torch.Tensor, ...]:
    """Codes, f16-valued scales (some negative) and offsets, as a Q4_1 (or, signed, a Q8_0) tensor holds them."""
    g = torch.Generator().manual_seed(seed)
    codes = (torch.randint(-128, 128, (N, K), generator=g) if signed else torch.randint(0, 16, (N, K), generator=g))
    d = (torch.randn(N, K // 32, generator=g) * 0.02).half().float()
    m = torch.full_like(d, -0.0) if signed else (torch.randn(N, K // 32, generator=g) * 0.05).half().float()
    return codes.to(torch.int8), d, m


@pytest.fixture(scope="module")
def smol_gguf(default_config):
    return gguf_path(default_config.model)


def test_parsed_blocks_decode_as_gguf_py_does(smol_gguf):
    """Each kind in the default model (Q4_1 layers, the Q8_0 embedding) decodes to gguf-py's values bit for bit: the
    converted model holds those."""
    seen = set()
    for tensor in GGUFReader(smol_gguf).tensors:
        kind = tensor.tensor_type
        if kind not in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0) or kind in seen:
            continue
        seen.add(kind)
        K = int(tensor.shape[0])
        raw = np.asarray(tensor.data)[:64]  # the first 64 rows
        expected = dequantize(raw, kind).reshape(raw.shape[0], K)
        rows = parse_blocks(kind, raw.reshape(raw.shape[0], -1), K)
        assert rows.codes.dtype == np.int8 and rows.d.shape == (raw.shape[0], K // 32)
        np.testing.assert_array_equal(rows.decoded().view(np.uint32), expected.astype(np.float32).view(np.uint32))
    assert seen == {GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}


def test_find_matches_rows_in_any_order_and_refuses_a_changed_bit():
    codes, d, m = _random_blocks(96, 64, seed=1)
    blocks = GgufBlocks({64: BlockRows(codes.numpy(), d.numpy(), m.numpy())})
    weight = decode_blocks(codes, d, m)
    order = torch.randperm(96, generator=torch.Generator().manual_seed(2))[:70]  # a fused or permuted weight's rows
    found = blocks.find(weight[order])
    assert found is not None
    for got, want in zip(found, (codes[order], d[order], m[order])):
        assert torch.equal(got, want)
    changed = weight[order].clone()
    changed[5, 7] = torch.nextafter(changed[5, 7], torch.tensor(1.0))
    assert blocks.find(changed) is None
    assert blocks.find(torch.randn(4, 96)) is None  # no rows of that width
    assert blocks.find(weight.bfloat16()) is None  # only fp32 weights decode from blocks


def test_pack_block_panels_layout():
    codes, d, m = _random_blocks(40, 64, seed=3)
    panels = pack_block_panels(codes, d, m)
    assert panels.shape == (2, 2, 1280) and panels.dtype == torch.int8
    block = panels[1, 1]  # columns 32-63 (only 32-39 real), inputs 32-63
    assert torch.equal(block[:128].view(torch.float32)[:8], d[32:40, 1])
    assert torch.equal(block[128:256].view(torch.float32)[:8], m[32:40, 1])
    assert torch.equal(block[256:].reshape(32, 32)[:, :8], codes[32:40, 32:64].T)
    assert not block[256:].reshape(32, 32)[:, 8:].any()  # padded columns
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_block_panels(codes[:, :48], d[:, :1], m[:, :1])


@needs_ops
@pytest.mark.parametrize("N, K", [(70, 64), (96, 576), (33, 1536)])
@pytest.mark.parametrize("signed", [False, True])
def test_block_gemm_equals_the_fp32_panels_bit_for_bit(N, K, signed):
    """Every row count's path (one pass, several register tiles over a kept decoded panel, several row blocks) and a
    ragged last panel give the fp32 panels' sums over the decoded weights exactly."""
    codes, d, m = _random_blocks(N, K, seed=N + K, signed=signed)
    weight = decode_blocks(codes, d, m)
    blocks, fp32 = pack_block_panels(codes, d, m), torch.ops.neuronmm.pack_panels_f32(weight)
    for rows in (1, 2, 3, 4, 7, 12, 13, 16, 49, 100):
        x = torch.randn(rows, K, generator=torch.Generator().manual_seed(rows))
        got = torch.ops.neuronmm.panel_linear_f32(x, blocks, N)
        assert torch.equal(got, torch.ops.neuronmm.panel_linear_f32(x, fp32, N)), rows
        torch.testing.assert_close(got, x @ weight.T, rtol=1e-4, atol=1e-4)


@needs_ops
def test_factored_call_takes_block_panels():
    """The C++ layer loop calls a projection through factored_linear: block panels pass through it too."""
    codes, d, m = _random_blocks(64, 96, seed=5)
    x = torch.randn(5, 96)
    got = torch.ops.neuronmm.factored_linear(x, pack_block_panels(codes, d, m), [64], [None], [64])
    assert torch.equal(got, torch.ops.neuronmm.panel_linear_f32(x, torch.ops.neuronmm.pack_panels_f32(
        decode_blocks(codes, d, m)), 64))


@needs_ops
def test_malformed_block_panels_are_refused():
    codes, d, m = _random_blocks(32, 64, seed=6)
    panels = pack_block_panels(codes, d, m)
    with pytest.raises(RuntimeError, match="GGUF block panels"):
        torch.ops.neuronmm.panel_linear_f32(torch.randn(2, 96), panels, 32)  # K does not match
    with pytest.raises(RuntimeError, match="GGUF block panels"):
        torch.ops.neuronmm.panel_linear_f32(torch.randn(2, 64), panels[:, :, :1000].contiguous(), 32)


_AVX2_BLOCKS = """
import torch
from server.models import fused_ops
assert fused_ops.load()
from server.models.gguf_blocks import decode_blocks, pack_block_panels
g = torch.Generator().manual_seed(0)
for N, K in ((70, 64), (40, 1536)):
    codes = torch.randint(-128, 128, (N, K), generator=g).to(torch.int8)
    d = (torch.randn(N, K // 32, generator=g) * 0.02).half().float()
    m = (torch.randn(N, K // 32, generator=g) * 0.05).half().float()
    blocks = pack_block_panels(codes, d, m)
    fp32 = torch.ops.neuronmm.pack_panels_f32(decode_blocks(codes, d, m))
    for rows in (1, 3, 4, 6, 7, 16, 49):
        x = torch.randn(rows, K, generator=g)
        assert torch.equal(torch.ops.neuronmm.panel_linear_f32(x, blocks, N),
                           torch.ops.neuronmm.panel_linear_f32(x, fp32, N)), (N, K, rows)
print("ok")
"""


@needs_ops
def test_avx2_build_gives_the_fp32_panels_sums(avx2_ops_env):
    """A CPU without AVX-512 runs the 8-wide tiles (whole panel at 1-3 rows, half panels after): the same sums."""
    done = subprocess.run([sys.executable, "-c", _AVX2_BLOCKS], env=avx2_ops_env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@needs_ops
def test_served_model_on_gguf_blocks_gives_the_fp32_logits(default_config, smol_dir):
    """The default model on its GGUF's blocks: every linear takes them, and a prompt's logits and a decode step's
    equal the fp32 model's bit for bit (same weights, same sums)."""
    source = gguf_path(default_config.model)
    plain = TorchRunner(smol_dir, 256, "float32", "cpu", num_threads=2)
    exact = TorchRunner(smol_dir, 256, "auto", "cpu", num_threads=2, quantization="gguf", gguf_source=source)
    logits = []
    for runner in (plain, exact):
        runner.load()
        runner.allocate_kv(2)
        prompt = runner.execute([SeqChunk(slot=0, token_ids=list(range(100, 140)), start_pos=0),
                                 SeqChunk(slot=1, token_ids=[7, 2, 9], start_pos=0)])
        step = runner.execute([SeqChunk(slot=0, token_ids=[4], start_pos=40),
                               SeqChunk(slot=1, token_ids=[8], start_pos=3)])
        logits.append((prompt, step))
    layouts = {m.layout for m in exact.model.modules() if hasattr(m, "layout")}
    assert layouts == {"GGUF block panels"} and exact.precision == "float32, gguf weights"
    for a, b in zip(*logits):
        assert torch.equal(a, b)


@needs_ops
def test_an_fp32_model_from_a_gguf_takes_its_blocks_unless_told_none(default_config, smol_dir):
    """Unset, fp32 weights on a CPU from a quantised GGUF are held as its blocks (the same sums); `none` keeps fp32
    panels, and so does a GGUF without Q4_1 / Q8_0 tensors, or a bf16 model."""
    source = gguf_path(default_config.model)
    unset = TorchRunner(smol_dir, 64, "float32", "cpu", gguf_source=source)
    assert unset.quantization == "gguf" and unset.blocks_by_default
    assert TorchRunner(smol_dir, 64, "float32", "cpu", quantization="none", gguf_source=source).quantization is None
    assert TorchRunner(smol_dir, 64, "bfloat16", "cpu", gguf_source=source).quantization is None
    assert TorchRunner(smol_dir, 64, "float32", "cpu").quantization is None  # a model from another source
    config = load_config(None, {"model.dtype": "float32"})
    assert gguf_source(config.model) == source
    assert gguf_source(load_config(None, {"model.quantization": "none"}).model) is None
    assert gguf_source(load_config(None, {"model.quantization": "int8"}).model) is None


@needs_ops
def test_a_gguf_without_blocks_keeps_fp32_unless_gguf_was_asked(tmp_path, smol_dir):
    from gguf import GGUFWriter  # a GGUF of plain f32 tensors
    writer = GGUFWriter(tmp_path / "plain.gguf", "llama")
    writer.add_tensor("w", np.ones((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GgufBlocks.read(tmp_path / "plain.gguf").empty
    cut = tmp_path / "cut.gguf"
    cut.write_bytes((tmp_path / "plain.gguf").read_bytes()[:40])  # a header that ends in the metadata
    with pytest.raises(ConfigError, match="cut.gguf is not a readable GGUF"):
        TorchRunner(smol_dir, 64, "float32", "cpu", gguf_source=cut).load()
    unset = TorchRunner(smol_dir, 64, "float32", "cpu", num_threads=2, gguf_source=tmp_path / "plain.gguf")
    unset.load()
    assert unset.quantization is None and unset.precision == "float32"
    asked = TorchRunner(smol_dir, 64, "float32", "cpu", quantization="gguf", gguf_source=tmp_path / "plain.gguf")
    with pytest.raises(ConfigError, match="holds no Q4_1 or Q8_0 tensors"):
        asked.load()


def test_gguf_quantization_needs_a_gguf_source_fp32_and_a_cpu(smol_dir, default_config):
    with pytest.raises(ConfigError, match="needs source gguf"):
        load_config(None, {"model.quantization": "gguf", "model.source": "safetensors", "model.path": str(smol_dir)})
    with pytest.raises(ConfigError, match="model.dtype: bfloat16 under quantization gguf"):
        check_backend_available(load_config(None, {"model.quantization": "gguf", "model.dtype": "bfloat16"}))
    with pytest.raises(ConfigError, match="quantization|CUDA"):
        check_backend_available(load_config(None, {"model.quantization": "gguf", "device": "cuda"}))
    with pytest.raises(ConfigError, match="needs model.source gguf"):
        TorchRunner(smol_dir, 64, "auto", "cpu", quantization="gguf")
