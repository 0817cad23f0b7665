"""The Llama family beyond Llama: Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms) and SmolLM3 (layers
without rotary) run as HF runs them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, MistralConfig, Qwen2Config

from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.config import ConfigError
from server.models.loader import load_llama
from support import live_server, tiny_config

SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "mistral": lambda vocab: MistralConfig(vocab_size=vocab, sliding_window=None, **SHAPE),
    "qwen2": lambda vocab: Qwen2Config(vocab_size=vocab, **SHAPE),
    # Qwen3's head_dim is its own (here wider than hidden / heads, as Qwen3-0.6B's 128 against 1024 / 16)
    "qwen3": lambda vocab: transformers.Qwen3Config(vocab_size=vocab, head_dim=32, **SHAPE),
    # SmolLM3 skips rotary in every no_rope_layer_interval-th layer: here the second of two
    "smollm3": lambda vocab: transformers.SmolLM3Config(vocab_size=vocab, no_rope_layer_interval=2, pad_token_id=None,
                                                        **SHAPE),
}
# transformers 4.48 (the Neuron DLC's, the compat CI job's) predates Qwen3
_CONFIGS = {"qwen3": "Qwen3Config", "smollm3": "SmolLM3Config"}
KNOWN = [pytest.param(name, marks=pytest.mark.skipif(
    not hasattr(transformers, _CONFIGS.get(name, "LlamaConfig")),
    reason=f"transformers {transformers.__version__} has no {_CONFIGS.get(name)}")) for name in sorted(FAMILIES)]


def _family_model(out: Path, family: str, tokenizer_dir: Path, **overrides) -> Path:
    """A 2-layer random model of the family, its biases and head norms random too (HF initialises them to 0 and 1,
    which would let a model that ignored them pass)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = FAMILIES[family](len(tok))
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=KNOWN)
def family_dir(request, tmp_path_factory, smol_dir) -> tuple[str, Path]:
    return request.param, _family_model(tmp_path_factory.mktemp(request.param), request.param, smol_dir)


def _hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("fused", [True, False], ids=["fused-ops", "reference-ops"])
def test_logits_equal_hf_over_a_prompt_and_decode_steps(family_dir, fused):
    family, model_dir = family_dir
    runner = TorchRunner(model_dir, 64, "float32", fused_kernels=fused)
    runner.load()
    attn = runner.model.layers[0].self_attn
    assert (attn.qkv_bias is not None) == (family == "qwen2") and (attn.q_norm is not None) == (family == "qwen3")
    runner.allocate_kv(1)
    ids = [5, 17, 42, 9, 300, 77, 12]
    ours = [runner.execute([SeqChunk(slot=0, token_ids=ids[:5], start_pos=0, all_logits=True)])]
    ours += [runner.execute([SeqChunk(slot=0, token_ids=[t], start_pos=5 + i)]) for i, t in enumerate(ids[5:])]
    torch.testing.assert_close(torch.cat(ours), _hf_logits(model_dir, ids), atol=1e-4, rtol=1e-4)


def test_bf16_follows_hf_in_bf16(family_dir):
    family, model_dir = family_dir
    runner = TorchRunner(model_dir, 64, "bfloat16")
    runner.load()
    runner.allocate_kv(1)
    ids = [5, 17, 42, 9, 300, 77, 12]
    ours = runner.execute([SeqChunk(slot=0, token_ids=ids, start_pos=0, all_logits=True)])
    torch.testing.assert_close(ours, _hf_logits(model_dir, ids), atol=0.1, rtol=0.05)


def test_a_family_model_is_served(family_dir):
    family, model_dir = family_dir
    with live_server(tiny_config(model_dir, max_model_len=256)) as live:
        import httpx
        answer = httpx.post(f"{live.url}/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}, timeout=60).json()
    assert answer["usage"]["completion_tokens"] >= 1 and answer["choices"][0]["message"]["role"] == "assistant"


def test_a_sliding_window_must_hold_the_whole_sequence(tmp_path, smol_dir):
    model_dir = _family_model(tmp_path / "mistral-swa", "mistral", smol_dir, sliding_window=128)
    with pytest.raises(ConfigError, match="sliding window of 128 tokens.*--max-model-len 128"):
        load_llama(model_dir, 256)
    assert load_llama(model_dir, 128).config.sliding_window == 128  # within the window attention is full


def test_other_architectures_are_refused_by_name(tmp_path, tiny_model_dir):
    config = (tiny_model_dir / "config.json").read_text().replace("LlamaForCausalLM", "GPT2LMHeadModel")
    for f in tiny_model_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "config.json").write_text(config)
    with pytest.raises(ConfigError, match="GPT2LMHeadModel.*not supported.*Qwen3ForCausalLM"):
        load_llama(tmp_path, 64)


def test_a_gguf_states_its_head_width(tmp_path):
    """The converter reads `<arch>.attention.key_length` (transformers leaves a Qwen3 GGUF's head_dim at hidden /
    heads, which Qwen3's is not); a file without it states none."""
    import numpy as np
    from gguf import GGUFWriter

    from server.models.source import _gguf_head_dim

    for name, key_length in (("qwen3", 128), ("llama", None)):
        writer = GGUFWriter(tmp_path / f"{name}.gguf", name)
        if key_length:
            writer.add_key_length(key_length)
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        assert _gguf_head_dim(tmp_path / f"{name}.gguf") == key_length


def test_a_compressed_family_model_serves_what_transformers_computes(family_dir, tmp_path):
    """`neuronmm compress` reads the family through transformers; the served factors give HF's logits with them."""
    from compression.compress import CompressSettings, compress_model
    from server.models.compressed import apply_artifact_to_hf

    family, model_dir = family_dir
    out = tmp_path / "art"
    compress_model(model_dir, CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32,
                                               batch_size=2, allocation="uniform"), out, model_id=family)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dense = _hf_logits(model_dir, [5, 17, 42, 9, 300])
    apply_artifact_to_hf(hf, out, model_dir)
    with torch.no_grad():
        expected = hf(torch.tensor([[5, 17, 42, 9, 300]])).logits[0]
    runner = TorchRunner(model_dir, 64, "float32", compressed=out)
    runner.load()
    runner.allocate_kv(1)
    ours = runner.execute([SeqChunk(slot=0, token_ids=[5, 17, 42, 9, 300], start_pos=0, all_logits=True)])
    assert not torch.allclose(expected, dense)  # the factors changed the model
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpp_layer_loop_runs_the_family_bit_for_bit(family_dir, dtype):
    """csrc/decoder.cpp adds Qwen2's biases and Qwen3's head norms as the Python loop does: the same logits."""
    from server.models.packed_linear import panels_available

    if not panels_available(torch.device("cpu"), dtype):
        pytest.skip(f"no {dtype} panel GEMM on this CPU")
    _, model_dir = family_dir
    runner = TorchRunner(model_dir, 64, str(dtype).removeprefix("torch."))
    runner.load()
    assert runner.model.decoder_plan() is not None

    def steps(use_plan: bool) -> list[torch.Tensor]:
        runner.model.use_decoder_plan = use_plan
        runner.allocate_kv(2)
        out = [runner.execute([SeqChunk(slot=0, token_ids=[5, 17, 42, 9], start_pos=0),
                               SeqChunk(slot=1, token_ids=[300, 77], start_pos=0)])]
        return out + [runner.execute([SeqChunk(slot=0, token_ids=[11 + i], start_pos=4 + i),
                                      SeqChunk(slot=1, token_ids=[13 + i], start_pos=2 + i)]) for i in range(3)]

    for planned, looped in zip(steps(True), steps(False), strict=True):
        assert torch.equal(planned, looped)
