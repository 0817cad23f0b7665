"""The padded decode step that CUDA graphs capture (server/backends/decode_graphs.py), run eagerly on the CPU with the
torch reference ops CUDA runs: the same logits as the unpadded step, and padding rows write only the scratch block.
Capture and replay themselves need a GPU: tests/server/test_cuda.py."""

from __future__ import annotations

import pytest
import torch

from server.backends.base import SeqChunk
from server.backends.decode_graphs import BATCH_SIZES, DecodeGraphs, padded_size
from server.backends.torch_runner import TorchRunner

BLOCK = 8
MAX_LEN = 64
PROMPTS = [[5, 9, 14, 3, 22, 7, 31, 2, 40, 11], [17, 4, 8], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62]]


def test_padded_size_rounds_up_to_a_captured_batch_size():
    assert [padded_size(n, 256) for n in (1, 2, 3, 5, 16, 17, 33, 200)] == [1, 2, 4, 8, 16, 24, 48, 256]
    assert padded_size(17, 16) is None  # above max_batch: eager
    assert padded_size(BATCH_SIZES[-1] + 1, 10**6) is None


@pytest.fixture()
def runner(tiny_model_dir):
    r = TorchRunner(tiny_model_dir, MAX_LEN, "float32", "cpu", fused_kernels=False)
    r.load()
    return r


def test_padded_step_gives_the_unpadded_logits_and_writes_only_the_scratch_block(runner):
    per_seq = MAX_LEN // BLOCK
    runner.allocate_kv_blocks(len(PROMPTS) * per_seq + 1, BLOCK)  # the last block: scratch
    scratch = len(PROMPTS) * per_seq
    for t in runner.cache.k + runner.cache.v:
        t.fill_(7.0)  # a sentinel: blocks nobody writes keep it
    graphs = DecodeGraphs(runner.model, runner.cache, scratch_block=scratch, max_batch=8,
                          max_blocks=per_seq, capture=False)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(PROMPTS))]
    runner.execute([SeqChunk(slot=i, token_ids=p, start_pos=0, block_table=tables[i][:2])
                    for i, p in enumerate(PROMPTS)])
    lens = [len(p) for p in PROMPTS]
    for step in range(4):
        chunks = [SeqChunk(slot=i, token_ids=[(step * 7 + i * 3) % 90 + 3], start_pos=lens[i],
                           block_table=tables[i][:lens[i] // BLOCK + 1]) for i in range(len(PROMPTS))]
        batch = runner.build_batch(chunks)
        assert graphs.applies(batch)
        eager = runner.model(batch, runner.cache)
        padded = graphs.run(batch)  # 3 rows run as 4: one padding row
        assert padded.shape == eager.shape
        torch.testing.assert_close(padded, eager, rtol=0, atol=1e-5)
        assert torch.equal(padded.argmax(-1), eager.argmax(-1))
        lens = [n + 1 for n in lens]
    used = {b for i, t in enumerate(tables) for b in t[:lens[i] // BLOCK + 1]}
    for t in runner.cache.k + runner.cache.v:
        written = {b for b in range(t.shape[0]) if not bool((t[b] == 7.0).all())}
        assert scratch in written and written <= used | {scratch}


def test_prefill_and_oversized_batches_stay_eager(runner):
    runner.allocate_kv_blocks(2 * (MAX_LEN // BLOCK) + 1, BLOCK)
    graphs = DecodeGraphs(runner.model, runner.cache, scratch_block=2 * (MAX_LEN // BLOCK), max_batch=1,
                          max_blocks=MAX_LEN // BLOCK, capture=False)
    prefill = runner.build_batch([SeqChunk(slot=0, token_ids=PROMPTS[0], start_pos=0, block_table=[0, 1])])
    assert not graphs.applies(prefill)  # ten tokens of one sequence
    two = runner.build_batch([SeqChunk(slot=i, token_ids=[3], start_pos=4, block_table=[i * 8]) for i in range(2)])
    assert not graphs.applies(two)  # above max_batch


def test_runner_keeps_graphs_off_the_cpu(runner):
    runner.allocate_kv_blocks(4, BLOCK)
    assert runner.graphs is None and runner.cache.num_blocks == 4
