"""NeuronRunner over a stand-in compiled model: buckets, chunked prefill, decode batching, padding metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from server.api.metrics import ServerMetrics
from server.backends.base import SeqChunk
from server.backends.neuron.layout import layer_keys
from server.backends.neuron.runner import NeuronRunner
from server.config import ConfigError, load_config
from server.engine.step_stats import StepStats
from server.models.artifact import FORMAT_VERSION, Manifest, ModuleRecord, save_artifact

VOCAB = 50
HF = {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "intermediate_size": 160,
      "num_hidden_layers": 2, "max_position_embeddings": 4096, "vocab_size": VOCAB}


class FakeTnx:
    """tnx's continuous-batching forward (tnx v0.13.0 llama/model.py:284, base.py:492-586, 700-710) over a toy cache.

    More than one token at position 0 encodes that one slot; any one-token input runs the decode graph over the whole
    compiled batch, where each row not in start_ids writes token 0 at position 0 (layers/attention.py:276-294,
    attention_utils.py:39-63). Logits row = one-hot of (sum of the slot's cached tokens up to the row's position)
    % vocab, in start_ids order, vocab padded as tnx pads it to a tp multiple.
    """

    def __init__(self, batch=8):
        self.calls, self.batch, self.kv = [], batch, {}

    def forward(self, input_ids, cache_ids=None, start_ids=None):
        self.calls.append((input_ids.tolist(), cache_ids.tolist(), start_ids.tolist()))
        if input_ids.shape[1] > 1:  # context encoding: one sequence (context_batch_sizes == [1])
            assert input_ids.shape[0] == 1 and int(cache_ids[0, 0]) == 0
            self.kv.setdefault(int(start_ids[0]), {}).update(zip(cache_ids[0].tolist(), input_ids[0].tolist()))
        else:
            given = {int(s): (int(t), int(p)) for s, t, p in zip(start_ids, input_ids[:, 0], cache_ids[:, 0])}
            assert len(given) == len(start_ids) and max(given) < self.batch
            for slot in range(self.batch):  # padding rows too: token 0 at position 0
                token, pos = given.get(slot, (0, 0))
                self.kv.setdefault(slot, {})[pos] = token
        out = torch.zeros(input_ids.shape[0], VOCAB + 14)
        for r, (slot, last) in enumerate(zip(start_ids.tolist(), cache_ids[:, -1].tolist())):
            out[r, sum(self.kv[slot].get(p, 0) for p in range(last + 1)) % VOCAB] = 1.0
        return out


def _want(*tokens):
    """The token FakeTnx's logits pick for a sequence whose cache holds `tokens` intact."""
    return sum(tokens) % VOCAB


@pytest.fixture(autouse=True)
def _no_outside_compile_cache(monkeypatch):
    """runner.load() sets NEURON_COMPILE_CACHE_URL for the SDK: undone after each test."""
    monkeypatch.delenv("NEURON_COMPILE_CACHE_URL", raising=False)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF))
    return tmp_path


def _runner(model_dir, tmp_path, compressed=None, **overrides):
    cfg = load_config("configs/llama-3.2-1b-trn1.yaml",
                      {"neuron.compile_cache": str(tmp_path / "cache"), "neuron.tp_degree": 1, **overrides})
    seen = {}

    def factory(path, args, factors, hf_config):
        seen.update(args=args, factors=factors)
        return FakeTnx()

    runner = NeuronRunner(cfg, model_dir, compressed, model_factory=factory)
    runner.load()
    return runner, seen


def test_decode_call_runs_before_the_steps_context_encodings(model_dir, tmp_path):
    """tnx's decode graph writes position 0 of every slot outside the call: a slot encoded before it would lose it."""
    runner, _ = _runner(model_dir, tmp_path)
    runner.execute([SeqChunk(3, [4, 5, 6], 0), SeqChunk(5, [7, 8], 0)])
    runner.model.calls.clear()
    logits = runner.execute([SeqChunk(3, [7], 3), SeqChunk(0, [1, 2, 3], 0), SeqChunk(5, [9], 2)])
    assert runner.model.calls == [
        ([[7], [9]], [[3], [2]], [3, 5]),           # decode: both tokens in one call, first
        ([[1, 2, 3]], [[0, 1, 2]], [0]),            # then slot 0's context encoding
    ]
    assert logits.shape == (3, VOCAB) and logits.dtype == torch.float32
    assert logits.argmax(1).tolist() == [_want(4, 5, 6, 7), _want(1, 2, 3), _want(7, 8, 9)]
    logits = runner.execute([SeqChunk(0, [4], 3), SeqChunk(3, [1], 4), SeqChunk(5, [2], 3)])
    assert logits.argmax(1).tolist() == [_want(1, 2, 3, 4), _want(4, 5, 6, 7, 1), _want(7, 8, 9, 2)]


def test_one_token_prompt_joins_the_decode_call(model_dir, tmp_path):
    """tnx decodes any one-token input; run alone, its padding rows would overwrite position 0 of live slots."""
    runner, _ = _runner(model_dir, tmp_path)
    runner.execute([SeqChunk(1, [5, 6], 0)])
    logits = runner.execute([SeqChunk(2, [9], 0), SeqChunk(1, [7], 2)])
    assert runner.model.calls[-1] == ([[9], [7]], [[0], [2]], [2, 1])
    assert logits.argmax(1).tolist() == [_want(9), _want(5, 6, 7)]
    logits = runner.execute([SeqChunk(4, [3], 0), SeqChunk(1, [8], 3), SeqChunk(2, [1], 1)])
    assert len(runner.model.calls) == 3 and logits.argmax(1).tolist() == [_want(3), _want(5, 6, 7, 8), _want(9, 1)]
    assert runner.padding.snapshot()[("decode", 8)]["real"] == 5
    runner.execute([SeqChunk(6, [2], 0, needs_logits=False)])  # the first chunk of a longer prompt: held
    assert len(runner.model.calls) == 3 and runner._pending == {6: [2]}


def test_chunked_prefill_is_held_until_last_chunk(model_dir, tmp_path):
    runner, _ = _runner(model_dir, tmp_path)
    out = runner.execute([SeqChunk(2, [1, 2], 0, needs_logits=False)])
    assert out.shape == (0, VOCAB) and runner.model.calls == []
    runner.execute([SeqChunk(2, [3, 4, 5], 2)])
    assert runner.model.calls == [([[1, 2, 3, 4, 5]], [[0, 1, 2, 3, 4]], [2])]
    with pytest.raises(ValueError, match="after 0 held"):
        runner.execute([SeqChunk(4, [1, 2], 3)])


def test_release_drops_held_prompt(model_dir, tmp_path):
    runner, _ = _runner(model_dir, tmp_path)
    runner.execute([SeqChunk(1, [1, 2], 0, needs_logits=False)])
    runner.release_slot(1)
    assert runner._pending == {}
    runner.execute([SeqChunk(1, [5], 0)])
    assert runner.model.calls == [([[5]], [[0]], [1])]


def test_abort_mid_prefill_does_not_break_the_next_step(model_dir, tmp_path):
    """Slot 1's sequence is aborted after its first chunk; the next step reuses slot 1 beside a decode."""
    runner, _ = _runner(model_dir, tmp_path)
    runner.execute([SeqChunk(0, [1, 2, 3, 4], 0)])
    runner.execute([SeqChunk(1, [1, 2], 0, needs_logits=False)])
    runner.release_slot(1)  # what the engine does for an aborted sequence
    logits = runner.execute([SeqChunk(1, [5, 6], 0, needs_logits=False), SeqChunk(0, [9], 4)])
    assert logits.argmax(1).tolist() == [_want(1, 2, 3, 4, 9)]
    logits = runner.execute([SeqChunk(1, [7], 2), SeqChunk(0, [3], 5)])
    assert runner.model.calls[-1][0] == [[5, 6, 7]]  # none of the aborted prompt's tokens
    assert logits.argmax(1).tolist() == [_want(5, 6, 7), _want(1, 2, 3, 4, 9, 3)]
    # an engine that never released the slot: a new prompt (position 0) still replaces the stale chunk
    runner.execute([SeqChunk(2, [1, 2], 0, needs_logits=False)])
    runner.execute([SeqChunk(2, [8], 0)])
    assert runner.model.calls[-1] == ([[8]], [[0]], [2]) and runner._pending == {}


def test_padding_per_bucket_reaches_metrics(model_dir, tmp_path):
    runner, _ = _runner(model_dir, tmp_path)
    runner.execute([SeqChunk(0, list(range(100)), 0)])                  # 100 tokens -> bucket 128
    runner.execute([SeqChunk(s, [1], 200) for s in range(3)])           # 3 seqs: tnx pads decode to 8
    runner.execute([SeqChunk(s, [1], 201) for s in range(5)])           # 5 seqs: padded to 8 too
    snap = runner.padding.snapshot()
    assert snap[("prefill", 128)] == {"runs": 1, "real": 100, "padding": 28}
    # batch_buckets [1, 4, 8]: only 8 exists for decode (batch_size_for_shared_caches)
    assert runner.decode_batch == 8 and {b for phase, b in snap if phase == "decode"} == {8}
    assert snap[("decode", 8)] == {"runs": 2, "real": 8, "padding": 8}
    metrics = ServerMetrics("m")
    metrics.observe_step(StepStats(batch_size=5, num_prompt_tokens=0, num_generation_tokens=5, padding=snap))
    text = metrics.render().decode()
    assert 'neuronmm_bucket_padding_slots_total{bucket="128",model_name="m",phase="prefill"} 28.0' in text
    assert 'neuronmm_bucket_real_slots_total{bucket="8",model_name="m",phase="decode"} 8.0' in text


def test_too_many_slots_or_tokens_fail_clearly(model_dir, tmp_path):
    runner, _ = _runner(model_dir, tmp_path)
    with pytest.raises(ConfigError, match="exceed the compiled batch 8"):
        runner.allocate_kv(9)
    with pytest.raises(ValueError, match="max_model_len"):
        runner.execute([SeqChunk(0, [1], 2048)])


def test_compressed_artifact_is_prepared_once_at_load(model_dir, tmp_path):
    art = tmp_path / "art"
    tensors, modules = {}, {}
    for proj in ("gate", "up", "down"):
        in_dim, out_dim = (160, 64) if proj == "down" else (64, 160)
        a, b = layer_keys(1, proj)
        tensors[a], tensors[b] = torch.randn(100, in_dim).bfloat16(), torch.randn(out_dim, 100).bfloat16()
        modules[a[:-2]] = ModuleRecord(rank=100, in_features=in_dim, out_features=out_dim)
    save_artifact(art, Manifest(format_version=FORMAT_VERSION, modules=modules, keep_ratio=0.8), tensors)
    runner, seen = _runner(model_dir, tmp_path, compressed=art)
    assert list(seen["factors"]) == [1]
    f = seen["factors"][1]
    assert f.gate_u.shape == (64, 128) and f.gate_v.shape == (128, 256) and f.down_v.shape == (128, 64)
    assert (tmp_path / "cache").is_dir()


def test_the_configs_compile_cache_is_the_sdks(model_dir, tmp_path, monkeypatch, caplog):
    """One compile cache: an outside NEURON_COMPILE_CACHE_URL would send the SDK's NEFFs to one folder and the
    pruned checkpoints (and the mkdir) to the config's."""
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "elsewhere"))
    with caplog.at_level("WARNING", logger="server.backends.neuron.runner"):
        _runner(model_dir, tmp_path)
    assert os.environ["NEURON_COMPILE_CACHE_URL"] == str(tmp_path / "cache")
    assert (tmp_path / "cache").is_dir() and not (tmp_path / "elsewhere").exists()
    assert "elsewhere" in caplog.text and "replaced by the config's" in caplog.text


def test_serve_without_sdk_is_one_line_exit_2():
    proc = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--config", "configs/llama-3.2-1b-trn1.yaml"],
                          capture_output=True, text=True, timeout=60)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and "neuronx-cc" in lines[0] and "transformers-neuronx" in lines[0]
    assert "docs/DEPLOY.md" in lines[0] and "Traceback" not in proc.stderr
