"""Engine units on a tiny random Llama: batching, chunked prefill, stops, aborts, faults."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from server.backends.base import SeqChunk
from server.config import EngineConfig
from server import runtime
from server.engine.sampling_params import SamplingParams
from server.models.gemm_tuning import Bf16Kernels
from server.runtime import CPU_PREFILL_CAP, build_engine, eos_token_ids, load_tokenizer, prefill_cap_while_decoding
from support import tiny_config


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    from server.backends import create_runner

    cfg = tiny_config(tiny_model_dir)
    runner = create_runner(cfg, tiny_model_dir)
    runner.load()
    tok = load_tokenizer(tiny_model_dir)
    return cfg, runner, tok


def make_engine(parts, **limits):
    cfg, runner, tok = parts
    cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update=limits)})
    return build_engine(cfg, runner, tok, eos_token_ids(runner.model_dir, tok))


def run_all(engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    for _ in range(10_000):
        if not engine.has_work():
            break
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out)
    return outs


GREEDY = dict(temperature=0.0, ignore_eos=True)


def test_batched_decode_ignores_uninitialised_cache(parts):
    """Padding rows of the batched decode read never-written cache memory; NaN there must not leak."""
    prompts = [[5, 17, 300, 9], [42] * 11]
    alone = []
    for p in prompts:
        engine = make_engine(parts)
        engine.add_request("r", p, SamplingParams(max_tokens=8, **GREEDY))
        alone.append([t for o in run_all(engine)["r"] for t in o.token_ids])
    engine = make_engine(parts)
    for t in parts[1].cache.k + parts[1].cache.v:  # what torch.empty may hand back
        t.fill_(float("nan"))
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=8, **GREEDY))
    outs = run_all(engine)
    assert engine.max_batch_size_seen == 2
    assert [[t for o in outs[f"r{i}"] for t in o.token_ids] for i in range(2)] == alone


def test_batched_greedy_equals_single_runs(parts):
    """Sequences decoded together in one forward give the same tokens as each decoded alone."""
    prompts = [[5, 17, 300, 9], [42] * 11, list(range(100, 123))]
    alone = []
    for p in prompts:
        engine = make_engine(parts)
        engine.add_request("r", p, SamplingParams(max_tokens=12, **GREEDY))
        alone.append([t for o in run_all(engine)["r"] for t in o.token_ids])
    engine = make_engine(parts)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=12, **GREEDY))
    outs = run_all(engine)
    assert engine.max_batch_size_seen == 3
    assert [[t for o in outs[f"r{i}"] for t in o.token_ids] for i in range(3)] == alone


def test_chunked_prefill_matches_whole_prefill(parts):
    """A prompt longer than the token budget is prefilled in chunks with identical results."""
    prompt = [(7 * i) % 4000 + 3 for i in range(150)]
    results = []
    for budget in (512, 16):
        engine = make_engine(parts, max_num_batched_tokens=budget)
        engine.add_request("r", prompt, SamplingParams(max_tokens=8, **GREEDY))
        outs = run_all(engine)["r"]
        results.append([t for o in outs for t in o.token_ids])
    assert results[0] == results[1]


def test_prefill_and_decode_share_a_forward(parts):
    """A new prompt is admitted into a running batch: one step carries a prefill chunk and a decode."""
    engine = make_engine(parts)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
    engine.step()  # a: prefill
    engine.add_request("b", list(range(10, 40)), SamplingParams(max_tokens=5, **GREEDY))
    chunks = engine.scheduler.schedule()
    kinds = sorted((c.seq.request_id, c.num_tokens) for c in chunks)
    assert kinds == [("a", 1), ("b", 30)]


def test_prompt_tokens_beside_decodes_are_capped_and_the_results_do_not_change(parts):
    """max_prefill_tokens_while_decoding: a step that decodes takes few prompt tokens; one that does not, its budget."""
    prompt = list(range(10, 50))
    results = []
    for cap in (None, 8):
        engine = make_engine(parts, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=cap)
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
        engine.add_request("c", list(range(60, 100)), SamplingParams(max_tokens=3, **GREEDY))
        first = sorted((c.seq.request_id, c.num_tokens) for c in engine.scheduler.schedule())
        assert first == [("a", 3), ("c", 40)]  # nothing decodes yet: the whole budget, cap or not
        engine = make_engine(parts, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=cap)
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
        engine.step()  # a: prefill; from here on it decodes
        engine.add_request("b", prompt, SamplingParams(max_tokens=5, **GREEDY))
        kinds = sorted((c.seq.request_id, c.num_tokens) for c in engine.scheduler.schedule())
        assert kinds == [("a", 1), ("b", 40 if cap is None else cap)]
        engine = make_engine(parts, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=cap)
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=20, **GREEDY))
        engine.step()
        engine.add_request("b", prompt, SamplingParams(max_tokens=5, **GREEDY))
        outs = run_all(engine)
        results.append({r: [t for o in outs[r] for t in o.token_ids] for r in ("a", "b")})
    assert results[0] == results[1]


@pytest.fixture(scope="module")
def fp32_parts(tiny_model_dir, parts):
    from server.backends import create_runner

    cfg = tiny_config(tiny_model_dir)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "float32"})})
    runner = create_runner(cfg, tiny_model_dir)
    runner.load()
    return cfg, runner, parts[2]


@pytest.mark.parametrize("setting, expected", [("auto", CPU_PREFILL_CAP), ("off", None), (None, None), (48, 48)])
def test_the_prefill_cap_the_engine_gets(fp32_parts, setting, expected):
    """auto resolves for the runner: a model in fp32 on the CPU is capped."""
    engine = make_engine(fp32_parts, max_prefill_tokens_while_decoding=setting)
    assert engine.scheduler.max_prefill_tokens_while_decoding == expected


@pytest.mark.parametrize("device, dtype, amx_rows, expected", [
    ("cpu", torch.float32, 0, CPU_PREFILL_CAP), ("cpu", torch.bfloat16, 0, CPU_PREFILL_CAP),
    ("cpu", torch.float32, 16, CPU_PREFILL_CAP), ("cpu", torch.bfloat16, 16, None), ("cuda", torch.float32, 0, None)])
def test_auto_caps_prompts_on_a_cpu_unless_bf16_runs_on_amx(monkeypatch, device, dtype, amx_rows, expected):
    monkeypatch.setattr(runtime, "bf16_kernels", lambda: Bf16Kernels(fma_rows=4, amx_rows=amx_rows))
    runner = SimpleNamespace(device=torch.device(device), dtype=dtype)
    assert prefill_cap_while_decoding(EngineConfig(), runner) == expected
    assert prefill_cap_while_decoding(EngineConfig(), SimpleNamespace()) is None  # a runner that says neither (Neuron)
    monkeypatch.setattr(runtime, "bf16_kernels", lambda: None)  # bf16 weights never packed (plain torch ops)
    assert prefill_cap_while_decoding(EngineConfig(), SimpleNamespace(device="cpu", dtype=torch.bfloat16)) == 128


def test_max_num_seqs_limits_running_and_queue_drains(parts):
    engine = make_engine(parts, max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", [3, 4, 5 + i], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    assert engine.scheduler.num_running == 2 and engine.scheduler.num_waiting == 3
    outs = run_all(engine)
    assert sorted(outs) == [f"r{i}" for i in range(5)]
    assert all(o[-1].finish_reason == "length" and o[-1].num_output_tokens == 4 for o in outs.values())
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.capacity


def test_abort_frees_slot_in_any_state(parts):
    engine = make_engine(parts, max_num_seqs=1)
    engine.add_request("running", [3, 4, 5], SamplingParams(max_tokens=50, **GREEDY))
    engine.add_request("queued", [3, 4, 6], SamplingParams(max_tokens=50, **GREEDY))
    engine.step()
    assert engine.abort("queued") == 1 and engine.abort("running") == 1  # the sequences it ended
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.capacity
    assert not engine.has_work()


def test_an_abort_counts_only_sequences_still_unfinished(parts):
    """A client that hangs up as its request's last token comes: the request ended once (not also as an abort)."""
    engine = make_engine(parts)
    engine.add_request("done", [3, 4, 5], SamplingParams(max_tokens=2, **GREEDY))
    engine.add_request("pair", [3, 4, 7], SamplingParams(max_tokens=50, **GREEDY), n=2)
    while not any(o.finish_reason for o in engine.step() if o.request_id == "done"):
        pass
    assert engine.abort("done") == 0 and engine.abort("nowhere") == 0
    assert engine.abort("pair") == 2 and engine.abort("pair") == 0


def test_stop_string_is_not_emitted(parts):
    engine = make_engine(parts)
    engine.add_request("free", [11, 12, 13], SamplingParams(max_tokens=30, **GREEDY))
    text = "".join(o.text for o in run_all(engine)["free"])
    stop = text[len(text) // 3: len(text) // 3 + 3]
    assert len(stop) == 3
    engine.add_request("stopped", [11, 12, 13], SamplingParams(max_tokens=30, stop=[stop], **GREEDY))
    outs = run_all(engine)["stopped"]
    stopped = "".join(o.text for o in outs)
    assert stop not in stopped and text.startswith(stopped) and outs[-1].finish_reason == "stop"
    engine.add_request("kept", [11, 12, 13], SamplingParams(max_tokens=30, stop=[stop], include_stop_str_in_output=True,
                                                            **GREEDY))
    assert "".join(o.text for o in run_all(engine)["kept"]) == stopped + stop  # vLLM's include_stop_str_in_output


def test_eos_ends_sequence(parts):
    cfg, runner, tok = parts
    engine = make_engine(parts)
    engine.add_request("free", [11, 12, 13], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    first = run_all(engine)["free"][0].token_ids[0]
    engine.eos_token_ids = frozenset({first})
    engine.add_request("eos", [11, 12, 13], SamplingParams(max_tokens=6, temperature=0.0))
    outs = run_all(engine)["eos"]
    assert len(outs) == 1 and outs[0].finish_reason == "stop"


@pytest.mark.parametrize("seed", [1234, None], ids=["request-seed", "engine-seed"])
def test_sampling_replays_and_n_choices_differ(parts, seed):
    """The request's seed (or, without one, engine.seed) replays the same tokens; n choices differ (seed + index)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=seed, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = make_engine(parts)
        engine.add_request("r", [20, 21, 22], params, n=2)
        outs = run_all(engine)["r"]
        runs.append([[t for o in outs if o.index == i for t in o.token_ids] for i in range(2)])
    assert runs[0] == runs[1]
    assert runs[0][0] != runs[0][1]


def test_forward_failure_fails_only_that_step(parts):
    class Faulty:
        def __init__(self, inner):
            self.inner, self.armed = inner, True

        def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
            if self.armed and any(c.start_pos > 0 for c in chunks):
                self.armed = False
                raise RuntimeError("injected")
            return self.inner.execute(chunks)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    engine = make_engine(parts)
    engine.runner = Faulty(engine.runner)
    engine.add_request("victim", [3, 4, 5], SamplingParams(max_tokens=5, **GREEDY))
    outs = run_all(engine)["victim"]
    assert outs[-1].finish_reason == "error" and "injected" in outs[-1].error
    assert engine.scheduler.kv.num_free == engine.scheduler.kv.capacity
    engine.add_request("after", [3, 4, 5], SamplingParams(max_tokens=5, **GREEDY))
    assert run_all(engine)["after"][-1].finish_reason == "length"

