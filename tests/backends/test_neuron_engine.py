"""The engine over NeuronRunner (with a torch stand-in for the compiled tnx model) generates what TorchRunner does.

Exercises the runner under the real scheduler: chunked prompts held back and encoded whole, decode
steps batched (one-token prompts with them), logits handed back in chunk order, slots reused after
release, and tnx's padding rows writing position 0 of the slots outside a decode call.
"""

from __future__ import annotations

import torch

from server.backends.base import SeqChunk
from server.backends.neuron.runner import NeuronRunner
from server.backends.torch_runner import TorchRunner
from server.config import load_config
from server.engine.llm_engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.runtime import allocate_kv, load_tokenizer

LIMITS = {"engine.max_model_len": 256, "engine.max_num_seqs": 4, "engine.max_num_batched_tokens": 24,
          "neuron.context_buckets": [64, 256], "neuron.batch_buckets": [1, 4], "neuron.tp_degree": 1}


class TorchStandIn:
    """tnx's continuous-batching forward(input_ids, cache_ids, start_ids) played by the CPU model, cache writes too.

    As in tnx (v0.13.0 base.py:503, 575-586, 703-710; layers/attention.py:276-294): more than one token encodes
    one sequence; any one-token input runs the decode graph over the whole compiled batch, and each slot outside
    the call gets token 0 written at position 0 of its cache.
    """

    def __init__(self, model_dir, max_model_len, num_slots):
        self.runner = TorchRunner(model_dir, max_model_len, num_threads=1)
        self.runner.load()
        self.runner.allocate_kv(num_slots)
        self.num_slots = num_slots
        self.shapes = []

    def forward(self, input_ids, cache_ids=None, start_ids=None):
        self.shapes.append(tuple(input_ids.shape))
        chunks = [SeqChunk(int(s), ids.tolist(), int(pos[0])) for ids, pos, s in zip(input_ids, cache_ids, start_ids)]
        if input_ids.shape[1] == 1:
            given = {c.slot for c in chunks}
            chunks += [SeqChunk(s, [0], 0, needs_logits=False) for s in range(self.num_slots) if s not in given]
        return self.runner.execute(chunks)


def _generate(runner, cfg, tokenizer, prompts, logits=None):
    """Greedy tokens per request; each step's logits appended to `logits` when given."""
    if logits is not None:
        execute = runner.execute
        runner.execute = lambda chunks: logits.append(execute(chunks)) or logits[-1]
    e = cfg.engine
    engine = LLMEngine(runner, tokenizer, e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len,
                       allocate_kv(cfg, runner))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    out = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.token_ids)
    return out


def test_engine_output_matches_torch_runner(tiny_model_dir, tmp_path):
    torch.set_num_threads(1)
    cfg = load_config("configs/llama-3.2-1b-trn1.yaml", {**LIMITS, "neuron.compile_cache": str(tmp_path / "c")})
    tokenizer = load_tokenizer(tiny_model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 30, 1, 50, 70, 9, 1)]
    stand_in = {}

    def factory(path, args, factors, hf_config):
        stand_in["model"] = TorchStandIn(path, cfg.engine.max_model_len, args.batch_buckets[-1])
        return stand_in["model"]

    neuron = NeuronRunner(cfg, tiny_model_dir, None, model_factory=factory)
    neuron.load()
    got_logits, want_logits = [], []
    got = _generate(neuron, cfg, tokenizer, prompts, got_logits)
    reference = TorchRunner(tiny_model_dir, 256, num_threads=1)
    reference.load()
    want = _generate(reference, cfg, tokenizer, prompts, want_logits)
    assert got == want and all(len(v) == 8 for v in got.values())
    # the random model's greedy tokens hardly depend on the context; its logits do (a position-0 KV overwritten by
    # a padding row moved them by ~0.5, different batching by < 1e-3)
    assert len(got_logits) == len(want_logits)
    for a, b in zip(got_logits, want_logits):
        torch.testing.assert_close(a, b, atol=1e-2, rtol=0)
    shapes = stand_in["model"].shapes
    assert (1, 70) in shapes and (1, 50) in shapes          # chunked prompts were encoded whole
    assert max(s[0] for s in shapes) >= 2 and all(s[1] == 1 for s in shapes if s[0] > 1)  # batched decode
    snap = neuron.padding.snapshot()
    # the one-token prompts ran on the decode graph, not a context bucket
    assert snap[("prefill", 64)]["real"] == 5 + 30 + 50 + 9 and snap[("prefill", 256)]["real"] == 70
