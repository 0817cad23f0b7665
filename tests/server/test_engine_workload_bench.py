"""bench.engine_workload drives the engine as bench.serve's client drives the server: every token, in waves."""

from __future__ import annotations

from bench.engine_workload import run_level
from server.backends import create_runner
from server.runtime import build_engine, eos_token_ids, load_tokenizer
from support import tiny_config


def test_a_level_generates_every_token_and_counts_full_decode_steps(tiny_model_dir):
    cfg = tiny_config(tiny_model_dir)
    runner = create_runner(cfg, tiny_model_dir)
    runner.load()
    tok = load_tokenizer(tiny_model_dir)
    engine = build_engine(cfg, runner, tok, eos_token_ids(tiny_model_dir, tok))
    prompts = [[5 + i, 6, 7, 8, 9] for i in range(6)]
    row = run_level(engine, prompts, concurrency=3, output_len=10, sampled=True)
    assert row["output_tokens"] == 6 * 10
    # two waves of three: each wave prefills, then decodes its other 9 tokens as a full batch
    assert row["num_decode_steps"] >= 2 * 8
    assert row["num_decode_steps"] + row["num_other_steps"] <= 2 * 10 + 2
    assert not engine.has_work()
