"""LoRA adapters over the served model (vLLM's --lora-modules): each row runs through its own adapter, as HF would
run the base model with that adapter merged into its weights."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import httpx
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench.harness import LORA_TARGETS, write_random_lora
from compression.compress import CompressSettings, compress_model
from server.backends import check_backend_available
from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.cli import build_parser, serve_overrides
from server.config import Config, ConfigError, validate_section
from server.engine.block_manager import PagedKV
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import Scheduler
from server.engine.sequence import Sequence
from server.models.compressed import apply_artifact_to_hf
from server.models.int8_linear import int8_available, quantize_linears_ref
from server.models.lora import load_lora_adapter
from server.models.packed_linear import panels_available
from server.runtime import build_engine, eos_token_ids
from support import live_server, tiny_config

ATTENTION, MLP = LORA_TARGETS[:4], LORA_TARGETS[4:]
PROMPT = [5, 17, 42, 9, 300, 77, 12, 1000, 64, 3]


def write_adapter(folder: Path, model_dir: Path, targets: tuple[str, ...], rank: int = 4, alpha: float = 8.0,
                  seed: int = 0, layers: tuple[int, ...] = (0, 1), **config) -> Path:
    """A PEFT LoRA folder with random A and B for the model in model_dir (bench.harness.write_random_lora)."""
    model_config = AutoConfig.from_pretrained(model_dir)
    return write_random_lora(folder, model_config, targets, rank, alpha, seed, layers, **config)


def merged_logits(model_dir: Path, adapter: Path | None, ids: list[int], artifact: Path | None = None,
                  int8: bool = False) -> torch.Tensor:
    """HF's logits over ids with the adapter applied as LoRA defines it (each target's output + alpha / r · x·Aᵀ·Bᵀ,
    by forward hooks, so it holds over a compressed artifact's low-rank modules and int8 weights too), fp32."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if artifact is not None:
        apply_artifact_to_hf(hf, artifact, model_dir)
    if int8:
        quantize_linears_ref(hf, torch.float64)  # as the int8 panel GEMM computes each projection and the LM head
    if adapter is not None:
        config = json.loads((adapter / "adapter_config.json").read_text())
        tensors = load_file(adapter / "adapter_model.safetensors")
        for key in [k for k in tensors if k.endswith(".lora_A.weight")]:
            name = key.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            A, B = tensors[key], tensors[key.replace("lora_A", "lora_B")]
            scale = config["lora_alpha"] / (A.shape[0] ** 0.5 if config.get("use_rslora") else A.shape[0])
            hf.get_submodule(name).register_forward_hook(
                lambda module, inputs, out, A=A, B=B, scale=scale: out + scale * (inputs[0] @ A.T) @ B.T)
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"every": write_adapter(root / "every", tiny_model_dir, ATTENTION + MLP, seed=1),
            "qv": write_adapter(root / "qv", tiny_model_dir, ("q_proj", "v_proj"), rank=8, alpha=16, seed=2),
            "mlp-rslora": write_adapter(root / "mlp", tiny_model_dir, MLP, rank=2, alpha=4, seed=3, layers=(1,),
                                        use_rslora=True)}


def _runner(model_dir: Path, adapters: dict[str, Path], fused: bool = True, dtype: str = "float32") -> TorchRunner:
    """fused: the C++ ops and packed weights, the adapters' updates on the panel GEMM where this CPU builds it; else
    torch's ops and GEMMs throughout."""
    runner = TorchRunner(model_dir, 64, dtype, fused_kernels=fused, pack_weights=fused, lora_modules=adapters)
    runner.load()
    return runner


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "reference-ops"])
@pytest.mark.parametrize("name", ["every", "qv", "mlp-rslora"])
def test_an_adapter_gives_the_merged_models_logits(tiny_model_dir, adapters, name, fused):
    runner = _runner(tiny_model_dir, adapters, fused)
    fast = [d.packed is not None for d in runner.loras[name].deltas.values()]
    assert all(fast) == (fused and panels_available(torch.device("cpu"), torch.float32)) and any(fast) == all(fast)
    runner.allocate_kv(1)
    ours = [runner.execute([SeqChunk(0, PROMPT[:7], 0, all_logits=True, lora=name)])]
    ours += [runner.execute([SeqChunk(0, [t], 7 + i, lora=name)]) for i, t in enumerate(PROMPT[7:])]
    expected = merged_logits(tiny_model_dir, adapters[name], PROMPT)
    torch.testing.assert_close(torch.cat(ours), expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, merged_logits(tiny_model_dir, None, PROMPT), atol=1e-2)  # it changes them


@pytest.mark.skipif(not hasattr(transformers, "Qwen3Config"), reason=f"transformers {transformers.__version__} "
                                                                     "has no Qwen3")
def test_the_update_goes_in_before_qwen3s_head_norms(smol_dir, tmp_path):
    tok = AutoTokenizer.from_pretrained(smol_dir)
    config = transformers.Qwen3Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      max_position_embeddings=4096, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norm weights of 1 would hide an update added after them only in scale
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model_dir = tmp_path / "qwen3"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    adapter = write_adapter(tmp_path / "qkv", model_dir, ATTENTION, seed=4)
    runner = _runner(model_dir, {"qkv": adapter})
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="qkv")])
    torch.testing.assert_close(ours, merged_logits(model_dir, adapter, PROMPT), atol=1e-4, rtol=1e-4)


def test_an_adapter_over_a_compressed_model(tiny_model_dir, adapters, tmp_path):
    """The product's case: adapters over an SVD artifact's low-rank MLP (the update adds to the factored projection's
    output), against transformers with the artifact applied and the adapter hooked in."""
    artifact = tmp_path / "art"
    compress_model(tiny_model_dir, CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32,
                                                    batch_size=2, allocation="uniform"), artifact, model_id="tiny")
    runner = TorchRunner(tiny_model_dir, 64, "float32", compressed=artifact, lora_modules=adapters)
    runner.load()
    assert runner.model.decoder_plan() is None or runner.loras["every"].plan is not None
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="every")])
    expected = merged_logits(tiny_model_dir, adapters["every"], PROMPT, artifact)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, merged_logits(tiny_model_dir, adapters["every"], PROMPT), atol=1e-3)


@pytest.mark.skipif(not (panels_available(torch.device("cpu"), torch.float32) and int8_available()),
                    reason="int8 weights need the int8 panel GEMM (AVX512-VNNI or AVX2)")
def test_an_adapter_over_int8_weights(tiny_model_dir, adapters):
    """The update runs on the unquantised x in the model's dtype and adds to the int8 projection's output."""
    runner = TorchRunner(tiny_model_dir, 64, "float32", quantization="int8", lora_modules=adapters)
    runner.load()
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="every")])
    expected = merged_logits(tiny_model_dir, adapters["every"], PROMPT, int8=True)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(expected, merged_logits(tiny_model_dir, adapters["every"], PROMPT), atol=1e-3)


def test_one_batch_runs_each_row_through_its_own_adapter(tiny_model_dir, adapters):
    """Base rows, two adapters, prompt chunks of different lengths (the last layer pruned to their last tokens) and a
    decode, in one forward: each sequence's logits are its own model's."""
    runner = _runner(tiny_model_dir, adapters)
    runner.allocate_kv(4)
    runner.execute([SeqChunk(3, PROMPT[:6], 0, lora="every")])  # its prompt first, then one decode in the batch
    names = [None, "every", "qv", "every"]
    logits = runner.execute([SeqChunk(0, PROMPT[:5], 0), SeqChunk(1, PROMPT[:9], 0, lora="every"),
                             SeqChunk(2, PROMPT[:4], 0, lora="qv"), SeqChunk(3, PROMPT[6:7], 6, lora="every")])
    ends = [5, 9, 4, 7]
    for row, (name, end) in enumerate(zip(names, ends)):
        expected = merged_logits(tiny_model_dir, adapters[name] if name else None, PROMPT[:end])[-1]
        torch.testing.assert_close(logits[row], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_cpp_layer_loop_applies_adapters_as_the_python_loop(tiny_model_dir, adapters, dtype):
    """A mixed batch (base rows, two adapters, prompt chunks whose last layer is pruned, a decode) through the C++
    layer loop (the adapters' LoraPlans) and through the Python loop: the same logits, bit for bit."""
    runner = _runner(tiny_model_dir, adapters, dtype=dtype)
    if runner.model.decoder_plan() is None or runner.loras["every"].plan is None:
        pytest.skip("the C++ layer loop needs the panel GEMM, which this CPU's build lacks")
    runner.allocate_kv(8)

    def step(first_slot: int) -> torch.Tensor:
        s = first_slot
        runner.execute([SeqChunk(s + 3, PROMPT[:6], 0, lora="every")])
        return runner.execute([SeqChunk(s, PROMPT[:5], 0), SeqChunk(s + 1, PROMPT[:9], 0, lora="every"),
                               SeqChunk(s + 2, PROMPT[:4], 0, lora="qv"),
                               SeqChunk(s + 3, PROMPT[6:7], 6, lora="every")])

    in_cpp = step(0)
    runner.model.use_decoder_plan = False
    assert torch.equal(in_cpp, step(4))


def test_bf16_adapter_follows_the_merged_model(tiny_model_dir, adapters):
    runner = _runner(tiny_model_dir, adapters, dtype="bfloat16")
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="every")])
    expected = merged_logits(tiny_model_dir, adapters["every"], PROMPT)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert (ours - expected).abs().max() < 0.1 * expected.abs().max()


def test_an_odd_rank_in_bf16_runs_through_the_python_loop(tiny_model_dir, tmp_path):
    """bf16 panels pair the inner dimension: a rank-3 update stays on torch's GEMMs, its steps in the Python loop."""
    adapter = write_adapter(tmp_path / "odd", tiny_model_dir, ("q_proj",), rank=3, alpha=6.0, seed=5)
    runner = _runner(tiny_model_dir, {"odd": adapter}, dtype="bfloat16")
    assert runner.loras["odd"].plan is None and all(d.packed is None for d in runner.loras["odd"].deltas.values())
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="odd")])
    expected = merged_logits(tiny_model_dir, adapter, PROMPT)
    assert (ours.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9
    assert (ours - expected).abs().max() < 0.1 * expected.abs().max()


def test_unusable_adapters_are_named(tiny_model_dir, tmp_path):
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config

    def load(folder: Path, max_rank: int = 16):
        return load_lora_adapter("x", folder, config, torch.float32, max_rank)

    with pytest.raises(ConfigError, match="neither a PEFT folder nor a .gguf file"):
        load(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        load(tmp_path / "empty")
    with pytest.raises(ConfigError, match="rank 32 is over max_lora_rank 16"):
        load(write_adapter(tmp_path / "big", tiny_model_dir, ("q_proj",), rank=32))
    corrupt = write_adapter(tmp_path / "corrupt", tiny_model_dir, ("q_proj",))
    (corrupt / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ConfigError, match="cannot read adapter_model.safetensors"):
        load(corrupt)
    with pytest.raises(ConfigError, match="use_dora"):
        load(write_adapter(tmp_path / "dora", tiny_model_dir, ("q_proj",), use_dora=True))
    folder = write_adapter(tmp_path / "head", tiny_model_dir, ("q_proj",))
    save_file({"base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64),
               "base_model.model.lm_head.lora_B.weight": torch.zeros(10, 4)}, folder / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="lm_head.lora_A.weight is not a LoRA factor"):
        load(folder)
    folder = write_adapter(tmp_path / "shape", tiny_model_dir, ("q_proj",))
    save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(64, 4)},
              folder / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"q_proj A \(4, 32\) / B \(64, 4\) do not fit"):
        load(folder)


def gguf_adapter(folder: Path, out: Path, model_dir: Path, dtype=np.float32, alpha: float | None = None,
                 arch: str = "llama", extra: dict[str, np.ndarray] | None = None) -> Path:
    """The PEFT folder as llama.cpp's convert_lora_to_gguf.py writes it: llama.cpp's tensor names, lora_a [r, in] and
    lora_b [out, r] per projection, q and k rows permuted into its rotary layout (the llama architecture), the
    alpha as adapter.lora.alpha (None: the folder's)."""
    config = AutoConfig.from_pretrained(model_dir)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}

    def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:  # llama.cpp's LlamaModel.permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(out, arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    adapter_config = json.loads((folder / "adapter_config.json").read_text())
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, adapter_config["lora_alpha"] if alpha is None else alpha)
    for key, tensor in load_file(folder / "adapter_model.safetensors").items():
        layer, module, factor = key.split(".")[4], key.split(".")[6], key.split(".")[7][-1].lower()
        if factor == "b" and module in heads:
            tensor = permute(tensor, heads[module])
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{factor}", tensor.numpy().astype(dtype))
    for name, values in (extra or {}).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_a_gguf_adapter_serves_the_logits_of_the_peft_folder_it_was_converted_from(tiny_model_dir, tmp_path, dtype):
    """llama.cpp's adapter format: read back with q and k un-permuted (the tiny model's 4 heads over 2 KV heads tell
    a wrong permutation, or none, apart) and alpha / rank as the scale; f16 tensors (the converter's default)
    dequantised. The folder holds values f16 can hold, so both files hold the same adapter."""
    folder = write_adapter(tmp_path / "peft", tiny_model_dir, ATTENTION + MLP, rank=4, alpha=6.0, seed=5)
    tensors = {k: v.half().float() for k, v in load_file(folder / "adapter_model.safetensors").items()}
    save_file(tensors, folder / "adapter_model.safetensors")
    converted = gguf_adapter(folder, tmp_path / "adapter.gguf", tiny_model_dir, dtype)
    runner = _runner(tiny_model_dir, {"g": converted})
    runner.allocate_kv(1)
    ours = [runner.execute([SeqChunk(0, PROMPT[:7], 0, all_logits=True, lora="g")])]
    ours += [runner.execute([SeqChunk(0, [t], 7 + i, lora="g")]) for i, t in enumerate(PROMPT[7:])]
    torch.testing.assert_close(torch.cat(ours), merged_logits(tiny_model_dir, folder, PROMPT), atol=1e-4, rtol=1e-4)
    assert runner.loras["g"].rank == 4


def test_a_gguf_adapter_without_alpha_applies_at_scale_one(tiny_model_dir, tmp_path):
    """llama.cpp applies an adapter whose alpha is 0 at scale 1: the folder's factors with alpha = rank."""
    folder = write_adapter(tmp_path / "peft", tiny_model_dir, ("q_proj", "down_proj"), rank=4, alpha=4.0, seed=6)
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    from_gguf = load_lora_adapter("g", gguf_adapter(folder, tmp_path / "a.gguf", tiny_model_dir, alpha=0.0), config,
                                  torch.float32, 16)
    from_folder = load_lora_adapter("f", folder, config, torch.float32, 16)
    assert from_gguf.deltas.keys() == from_folder.deltas.keys()
    for key, delta in from_folder.deltas.items():
        assert torch.equal(from_gguf.deltas[key].A, delta.A) and torch.equal(from_gguf.deltas[key].B, delta.B)


def test_unusable_gguf_adapters_are_named(tiny_model_dir, tmp_path):
    config = AutoModelForCausalLM.from_pretrained(tiny_model_dir).config
    folder = write_adapter(tmp_path / "peft", tiny_model_dir, ("q_proj",))

    def load(path: Path):
        return load_lora_adapter("x", path, config, torch.float32, 16)

    with pytest.raises(ConfigError, match="converted for llama.cpp architecture 'qwen2'"):
        load(gguf_adapter(folder, tmp_path / "qwen.gguf", tiny_model_dir, arch="qwen2"))
    with pytest.raises(ConfigError, match="blk.0.attn_norm.weight is not a LoRA factor"):
        load(gguf_adapter(folder, tmp_path / "norm.gguf", tiny_model_dir,
                          extra={"blk.0.attn_norm.weight": np.ones(64, dtype=np.float32)}))
    model = gguf.GGUFWriter(tmp_path / "model.gguf", "llama")  # a model file, not an adapter
    model.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    model.write_header_to_file(), model.write_kv_data_to_file(), model.write_tensors_to_file(), model.close()
    with pytest.raises(ConfigError, match="a GGUF file but not a LoRA adapter"):
        load(tmp_path / "model.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF but not really")
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        load(tmp_path / "junk.gguf")


def _engine(model_dir: Path, adapters: dict[str, Path], **engine):
    cfg = tiny_config(model_dir, enable_lora=True, lora_modules={k: str(v) for k, v in adapters.items()}, **engine)
    runner = _runner(model_dir, adapters)
    tok = AutoTokenizer.from_pretrained(model_dir)
    return build_engine(cfg, runner, tok, eos_token_ids(model_dir, tok))


def _run(engine, requests: dict[str, tuple[list[int], str | None]]) -> dict[str, list[int]]:
    for rid, (ids, lora) in requests.items():
        engine.add_request(rid, ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, lora=lora))
    got = {rid: [] for rid in requests}
    while engine.has_work():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    return got


def test_prefix_cache_keeps_each_adapters_blocks_apart(tiny_model_dir, adapters):
    """The same 40-token prompt through the base model and then an adapter: the adapter's K/V differ, so it finds
    no block of the base's; a second request to the adapter finds its own, and answers the same."""
    engine = _engine(tiny_model_dir, adapters)
    prompt = (PROMPT * 4)[:40]
    first = _run(engine, {"base": (prompt, None)})
    hits_before = engine.scheduler.kv.stats.prefix_hits
    alone = _run(engine, {"a1": (prompt, "every")})
    assert engine.scheduler.kv.stats.prefix_hits == hits_before  # nothing of the base's served the adapter
    again = _run(engine, {"a2": (prompt, "every")})
    assert engine.scheduler.kv.stats.prefix_hits - hits_before == 32  # its own two full blocks
    assert again["a2"] == alone["a1"] != first["base"]
    expected = merged_logits(tiny_model_dir, adapters["every"], prompt)[-1].argmax().item()
    assert alone["a1"][0] == expected


def test_unknown_adapter_is_refused_by_the_engine(tiny_model_dir, adapters):
    engine = _engine(tiny_model_dir, adapters)
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'"):
        engine.add_request("x", PROMPT, SamplingParams(lora="nope"))


def _seq(rid: str, lora: str | None) -> Sequence:
    return Sequence(rid, 0, list(PROMPT), SamplingParams(max_tokens=4, lora=lora), None)


def test_max_loras_holds_a_third_adapter_back_and_lets_others_pass():
    scheduler = Scheduler(8, 256, PagedKV(64, 16, enable_prefix_caching=False), max_loras=2)
    for rid, lora in [("a", "A"), ("b", "B"), ("c", "C"), ("base", None), ("a2", "A")]:
        scheduler.add(_seq(rid, lora))
    scheduled = [c.seq.request_id for c in scheduler.schedule()]
    assert scheduled == ["a", "b", "base", "a2"]
    assert [s.request_id for s in scheduler.waiting] == ["c"]
    scheduler.finish(scheduler.running[0], "stop")  # A's first request ends; A still runs (a2)
    assert [c.seq.request_id for c in scheduler.schedule() if c.seq.request_id == "c"] == []
    scheduler.finish(next(s for s in scheduler.running if s.request_id == "a2"), "stop")
    assert "c" in [c.seq.request_id for c in scheduler.schedule()]


def test_served_adapters(tiny_model_dir, adapters):
    cfg = tiny_config(tiny_model_dir, enable_lora=True, lora_modules={k: str(v) for k, v in adapters.items()},
                      max_loras=3)
    with live_server(cfg) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        cards = {c["id"]: c for c in client.get("/v1/models").json()["data"]}
        assert cards["every"]["parent"] == "tiny" and cards["every"]["root"] == str(adapters["every"])
        assert cards["tiny"]["parent"] is None

        def complete(model: str, **extra) -> dict:
            body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **extra}
            return client.post("/v1/completions", json=body).json()

        folders = {"tiny": None, "every": adapters["every"], "qv": adapters["qv"]}
        # each model's top first-token logprob (-9.90, -10.12, -10.14 here): the served one is nearest its own model's
        expected = {m: merged_logits(tiny_model_dir, f, PROMPT)[-1].log_softmax(-1).max().item()
                    for m, f in folders.items()}
        for model in folders:
            reply = complete(model, logprobs=1)
            assert reply["model"] == model
            served = max(reply["choices"][0]["logprobs"]["top_logprobs"][0].values())
            assert min(expected, key=lambda m: abs(expected[m] - served)) == model
            assert served == pytest.approx(expected[model], abs=5e-3)  # (served in bf16 here)
        streamed = client.post("/v1/chat/completions", json={"model": "qv", "stream": True, "max_tokens": 2,
                                                              "messages": [{"role": "user", "content": "hi"}]})
        models = {json.loads(line[6:])["model"] for line in streamed.text.splitlines()
                  if line.startswith("data: {")}
        assert models == {"qv"}
        embedded = client.post("/v1/embeddings", json={"model": "every", "input": "hi"}).json()
        base = client.post("/v1/embeddings", json={"model": "tiny", "input": "hi"}).json()
        assert embedded["model"] == "every" and embedded["data"][0]["embedding"] != base["data"][0]["embedding"]
        missing = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert missing.status_code == 404 and "every" in missing.json()["error"]["message"]


def test_config_and_flags(monkeypatch):
    with pytest.raises(ConfigError, match="lora_modules needs enable_lora"):
        validate_section(Config, {"model": {"name": "m", "path": "x.gguf"}, "engine": {"lora_modules": {"a": "/a"}}},
                         "cfg")
    with pytest.raises(ConfigError, match="m is also the served model's name"):
        validate_section(Config, {"model": {"name": "m", "path": "x.gguf"},
                                  "engine": {"enable_lora": True, "lora_modules": {"m": "/a"}}}, "cfg")
    cfg = Config.model_validate({"model": {"name": "m", "path": "x.gguf"}, "backend": "neuron",
                                 "engine": {"enable_lora": True, "lora_modules": {"a": "/a"}}})
    with pytest.raises(ConfigError, match="neuron backend serves no LoRA adapters"):
        check_backend_available(cfg)
    args = build_parser().parse_args(["serve", "--enable-lora", "--max-loras", "2", "--lora-modules", "sql=/ad/sql",
                                      '{"name": "chat", "path": "/ad/chat"}'])
    _, overrides = serve_overrides(args)
    assert overrides["engine.lora_modules"] == {"sql": "/ad/sql", "chat": "/ad/chat"}
    assert overrides["engine.enable_lora"] and overrides["engine.max_loras"] == 2
    assert overrides["server.allow_runtime_lora_updating"] is None
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")  # vLLM's switch, as vLLM reads it
    assert serve_overrides(args)[1]["server.allow_runtime_lora_updating"] is True
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--lora-modules", "no-path"])


def test_unloading_an_adapter_in_use_is_refused(tiny_model_dir, adapters):
    engine = _engine(tiny_model_dir, adapters)
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, lora="qv"))
    with pytest.raises(ValueError, match="'qv' has 1 sequences in flight"):
        engine.unload_lora("qv")
    with pytest.raises(LookupError, match="'nope' cannot be found"):
        engine.unload_lora("nope")
    engine.abort("r")
    engine.unload_lora("qv")
    assert "qv" not in engine.runner.loras


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_adapters_loaded_and_unloaded_at_run_time(tiny_model_dir, adapters, tmp_path, engine_process):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter: a loaded adapter serves its own logits; a folder
    loaded again under a name it had serves the new weights (no K/V cached under the old one is reused)."""
    cfg = tiny_config(tiny_model_dir, enable_lora=True, lora_modules={"every": str(adapters["every"])})
    cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"allow_runtime_lora_updating": True})})
    second = write_adapter(tmp_path / "second", tiny_model_dir, ATTENTION + MLP, seed=7)
    prompt = (PROMPT * 4)[:40]  # two full blocks: cached after the first request

    with live_server(cfg, engine_process=engine_process) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        def top_logprob(model: str) -> float:
            reply = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1,
                                                         "temperature": 0, "logprobs": 1})
            assert reply.status_code == 200, reply.text
            return max(reply.json()["choices"][0]["logprobs"]["top_logprobs"][0].values())

        def expected(folder: Path) -> float:
            return merged_logits(tiny_model_dir, folder, prompt)[-1].log_softmax(-1).max().item()

        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(adapters["qv"])})
        assert loaded.status_code == 200 and loaded.text == "Success: LoRA adapter 'late' added successfully."
        assert "late" in {c["id"] for c in client.get("/v1/models").json()["data"]}
        assert top_logprob("late") == pytest.approx(expected(adapters["qv"]), abs=5e-3)
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(second)})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        bad = client.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": str(tmp_path / "none")})
        assert bad.status_code == 400 and "neither a PEFT folder nor a .gguf file" in bad.json()["error"]["message"]
        clash = client.post("/v1/load_lora_adapter", json={"lora_name": "tiny", "lora_path": str(second)})
        assert clash.status_code == 400

        gone = client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert gone.status_code == 200 and gone.text == "Success: LoRA adapter 'late' removed successfully."
        assert client.post("/v1/completions", json={"model": "late", "prompt": "x"}).status_code == 404
        unknown = client.post("/v1/unload_lora_adapter", json={"lora_name": "late"})
        assert unknown.status_code == 404 and "cannot be found" in unknown.json()["error"]["message"]

        reload = client.post("/v1/load_lora_adapter", json={"lora_name": "late", "lora_path": str(second)})
        assert reload.status_code == 200
        assert top_logprob("late") == pytest.approx(expected(second), abs=5e-3)
        assert top_logprob("every") == pytest.approx(expected(adapters["every"]), abs=5e-3)


def test_max_loras_holds_with_lora_enabled_and_no_adapter_at_start(tiny_model_dir):
    """--enable-lora alone (adapters to come at run time): the engine still keeps to max_loras and reports them."""
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = build_engine(tiny_config(tiny_model_dir, enable_lora=True, max_loras=2), _runner(tiny_model_dir, {}), tok,
                          eos_token_ids(tiny_model_dir, tok))
    assert engine.scheduler.max_loras == 2


def test_runtime_updates_are_off_unless_asked(tiny_model_dir, adapters):
    cfg = tiny_config(tiny_model_dir, enable_lora=True, lora_modules={"every": str(adapters["every"])})
    with live_server(cfg) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        refused = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapters["qv"])})
        assert refused.status_code == 404 and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in refused.json()["error"]["message"]


def test_an_adapter_saved_by_peft_serves_peft_logits(tiny_model_dir, tmp_path):
    """The format as PEFT writes it (its own key names and config), against PeftModel's forward."""
    peft = pytest.importorskip("peft", reason="PEFT is not a dependency: this check runs where it is installed")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=list(LORA_TARGETS), use_rslora=True,
                             init_lora_weights=False)  # random B: PEFT's default zero would change nothing
    model = peft.get_peft_model(hf, config).eval()
    model.save_pretrained(tmp_path / "peft")
    with torch.no_grad():
        expected = model(torch.tensor([PROMPT])).logits[0]
    runner = _runner(tiny_model_dir, {"p": tmp_path / "peft"})
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="p")])
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_lora_requests_info_names_the_running_and_waiting_adapters(tiny_model_dir, adapters):
    """vLLM's vllm:lora_requests_info gauge, which its Grafana dashboard reads: with max_loras 1 the first adapter
    runs while the second waits; the gauge shows the latest step's state in one series."""
    engine = _engine(tiny_model_dir, adapters)  # max_loras 1
    seen = []
    engine.observers.append(lambda stats: seen.append((stats.lora.running, stats.lora.waiting)))
    _run(engine, {"a": (PROMPT, "every"), "b": (PROMPT, "qv")})
    assert seen[0] == (("every",), ("qv",)) and (("qv",), ()) in seen and seen[-1] == ((), ())
    cfg = tiny_config(tiny_model_dir, enable_lora=True, lora_modules={k: str(v) for k, v in adapters.items()},
                      max_loras=2)
    with live_server(cfg) as srv, httpx.Client(base_url=srv.url, timeout=60) as client:
        assert client.post("/v1/completions", json={"model": "qv", "prompt": PROMPT, "max_tokens": 2}).status_code == 200
        lines = [line for line in client.get("/metrics").text.splitlines()
                 if line.startswith("vllm:lora_requests_info{")]
    assert len(lines) == 1 and 'max_lora="2"' in lines[0] and 'waiting_lora_adapters=""' in lines[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")
def test_adapters_on_cuda_give_the_merged_models_logits(tiny_model_dir, adapters):
    """On a CUDA device the updates run as torch's GEMMs (no panel GEMM there), decode steps eagerly beside the
    captured graphs the base rows replay."""
    runner = TorchRunner(tiny_model_dir, 64, "float32", device="cuda", lora_modules=adapters, max_num_seqs=2)
    runner.load()
    runner.allocate_kv(2)
    logits = runner.execute([SeqChunk(0, PROMPT, 0, all_logits=True, lora="every"),
                             SeqChunk(1, PROMPT, 0, all_logits=True)]).cpu()
    n = len(PROMPT)
    torch.testing.assert_close(logits[:n], merged_logits(tiny_model_dir, adapters["every"], PROMPT), atol=1e-3,
                               rtol=1e-3)
    torch.testing.assert_close(logits[n:], merged_logits(tiny_model_dir, None, PROMPT), atol=1e-3, rtol=1e-3)
