"""The PyTorch backend on CUDA, against the CPU: greedy tokens, the auto dtype, compressed factors, recovery's
training step and run on the GPU, and the served API with its engine process; decode steps replayed from CUDA graphs
against the same steps op by op. Skipped without a CUDA device (CI has none); docs/BENCHMARKS.md records the runs on
lent GPUs."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from compression.compress import CompressSettings, compress_model
from compression.recovery import recover_artifact
from compression.recovery.adapter import adapter_parameters
from compression.recovery.distill import distill_backward, shared_prefix_layers
from compression.recovery.recover import load_adapted_model, load_teacher
from server.backends.base import SeqChunk
from server.backends.torch_runner import TorchRunner
from server.config import Config, RecoveryConfig, data_dir
from server.models.artifact import load_artifact
from server.runtime import load_tokenizer
from support import engine_greedy, live_server, tiny_config

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")]

PROMPTS = ["The three primary colors are", "def fibonacci(n):",
           "Paris is the capital of France, and Berlin is the capital of Germany. " * 6]
# the long prompt (~100 tokens) is prefilled in chunks of the batch budget (64): SDPA chunks, the later ones
# attending a cached prefix through an explicit mask (the non-CPU path of Attention._attend_chunk)
NEW_TOKENS = 24
MAX_LEN = 256
# fp32 on both devices: the GEMMs sum in another order, so a chosen token may trail the CPU's best logit by
# rounding (the tiny model's logits are below 1: 1e-4 is hundreds of fp32 ulps and far below any real gap)
FP32_TIE = 1e-4


def _runner(model_dir, device: str, dtype: str = "float32", compressed=None, kv_cache_dtype: str = "auto",
            cuda_graphs: bool = True) -> TorchRunner:
    runner = TorchRunner(model_dir, MAX_LEN, dtype, device, compressed, kv_cache_dtype=kv_cache_dtype,
                         cuda_graphs=cuda_graphs)
    runner.load()
    return runner


def _greedy(model_dir, device: str, dtype: str = "float32", compressed=None) -> list[list[int]]:
    runner = _runner(model_dir, device, dtype, compressed)
    return engine_greedy(model_dir, runner, load_tokenizer(model_dir), PROMPTS, NEW_TOKENS, MAX_LEN)


def _prompt_logits(runner: TorchRunner, ids: list[int], split: int = 48) -> torch.Tensor:
    """fp32 logits of every position of one prompt prefilled in two chunks (the second over a cached prefix)."""
    runner.allocate_kv(1)
    first = runner.execute([SeqChunk(slot=0, token_ids=ids[:split], start_pos=0, all_logits=True)])
    rest = runner.execute([SeqChunk(slot=0, token_ids=ids[split:], start_pos=split, all_logits=True)])
    return torch.cat([first, rest]).float().cpu()


def _assert_greedy_of(model, tok, outputs: list[list[int]]) -> None:
    """Each token is the CPU model's argmax given the same prefix, up to FP32_TIE (teacher-forced)."""
    for prompt, tokens in zip(PROMPTS, outputs):
        ids = tok(prompt).input_ids
        assert len(tokens) == NEW_TOKENS
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1].float()
        chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        gap = (logits.max(-1).values - chosen).max().item()
        assert gap <= FP32_TIE, (prompt, gap)


@pytest.fixture(scope="module")
def artifact(tiny_model_dir, tmp_path_factory):
    """The tiny model SVD-compressed at keep 0.5 (calibration on the shared C4 sample, on the CPU)."""
    if not (data_dir() / "c4" / "c4-validation-sample.jsonl").is_file():
        pytest.skip("shared C4 sample not present")
    out = tmp_path_factory.mktemp("cuda-art") / "tiny-k05"
    settings = CompressSettings(keep_ratio=0.5, rank_multiple=8, calib_samples=4, calib_seqlen=32, batch_size=2,
                                allocation="uniform")
    compress_model(tiny_model_dir, settings, out, model_id="tiny")
    return out


def test_fp32_greedy_on_cuda_is_the_cpu_models_greedy(tiny_model_dir):
    """The engine on CUDA chooses the CPU reference model's argmax at every step (3 prompts in one batch)."""
    ours = _greedy(tiny_model_dir, "cuda")
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    _assert_greedy_of(hf, load_tokenizer(tiny_model_dir), ours)


@pytest.mark.parametrize("dtype", ["float32", "auto"])
def test_decode_steps_replayed_from_cuda_graphs_match_the_same_steps_run_eagerly(tiny_model_dir, dtype):
    """Paged decode steps of 3 and then 1 sequences (padded to 4 and 1) replayed from captured graphs give the logits
    of the same padded steps run op by op (the CPU tests check padded against unpadded); both sizes were captured."""
    tok = load_tokenizer(tiny_model_dir)
    prompts = [tok(p).input_ids for p in PROMPTS]
    logits = {}
    for replay in (True, False):
        runner = _runner(tiny_model_dir, "cuda", dtype)
        runner.allocate_kv_blocks(3 * (MAX_LEN // 16), 16)
        runner.graphs.capture = replay
        tables = [list(range(i * (MAX_LEN // 16), (i + 1) * (MAX_LEN // 16))) for i in range(3)]
        runner.execute([SeqChunk(slot=i, token_ids=p, start_pos=0, block_table=tables[i])
                        for i, p in enumerate(prompts)])
        lens, steps = [len(p) for p in prompts], []
        for step in range(6):
            live = range(3) if step < 3 else range(1)
            chunks = [SeqChunk(slot=i, token_ids=[100 + 7 * step + i], start_pos=lens[i], block_table=tables[i])
                      for i in live]
            steps.append(runner.execute(chunks).float().cpu())
            lens = [n + 1 if i in live else n for i, n in enumerate(lens)]
        assert runner.graphs.captured_sizes == ([1, 4] if replay else [])
        logits[replay] = steps
    for replayed, eager in zip(logits[True], logits[False]):
        assert not replayed.isnan().any()
        torch.testing.assert_close(replayed, eager, rtol=0, atol=1e-6)


def test_the_engines_batch_sizes_are_captured_at_start_up(tiny_model_dir):
    """With the engine's max_num_seqs (5) the runner captures sizes 1, 2, 4 and 8 when its cache is allocated (every
    row padding then); a step of 5 sequences then replays the size-8 graph, giving the op-by-op step's logits."""
    tok = load_tokenizer(tiny_model_dir)
    prompts = [tok(p).input_ids for p in PROMPTS] + [tok("Hello there").input_ids, tok("1, 2, 3,").input_ids]
    logits = []
    for graphs in (True, False):
        runner = TorchRunner(tiny_model_dir, MAX_LEN, "float32", "cuda", cuda_graphs=graphs, max_num_seqs=5)
        runner.load()
        runner.allocate_kv_blocks(5 * (MAX_LEN // 16), 16)
        assert (runner.graphs.captured_sizes if graphs else runner.graphs) == ([1, 2, 4, 8] if graphs else None)
        tables = [list(range(i * (MAX_LEN // 16), (i + 1) * (MAX_LEN // 16))) for i in range(5)]
        runner.execute([SeqChunk(slot=i, token_ids=p, start_pos=0, block_table=tables[i])
                        for i, p in enumerate(prompts)])
        step = [SeqChunk(slot=i, token_ids=[42 + i], start_pos=len(p), block_table=tables[i])
                for i, p in enumerate(prompts)]
        logits.append(runner.execute(step).float().cpu())
        if graphs:
            assert runner.graphs.captured_sizes == [1, 2, 4, 8]  # replayed, nothing captured on the way
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=FP32_TIE)  # padded GEMMs sum in another order


def test_enforce_eager_runs_cuda_steps_op_by_op(tiny_model_dir):
    runner = _runner(tiny_model_dir, "cuda", cuda_graphs=False)
    runner.allocate_kv_blocks(8, 16)
    assert runner.graphs is None and runner.cache.num_blocks == 8  # no scratch block either


def test_prefill_logits_on_cuda_match_the_cpu(tiny_model_dir):
    ids = load_tokenizer(tiny_model_dir)(PROMPTS[2]).input_ids
    assert len(ids) > 80
    cpu = _prompt_logits(_runner(tiny_model_dir, "cpu"), ids)
    gpu = _prompt_logits(_runner(tiny_model_dir, "cuda"), ids)
    assert gpu.shape == cpu.shape == (len(ids), cpu.shape[1])
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=1e-4)


def test_an_fp8_kv_cache_on_cuda_gives_the_cpus_logits(tiny_model_dir):
    """engine.kv_cache_dtype fp8 on CUDA (the torch path: a saturating cast, SDPA over the widened cache) against the
    CPU's fused kernel over the same rounded cache; both apart from the fp32 cache's logits."""
    ids = load_tokenizer(tiny_model_dir)(PROMPTS[2]).input_ids
    cpu = _prompt_logits(_runner(tiny_model_dir, "cpu", kv_cache_dtype="fp8"), ids)
    gpu_runner = _runner(tiny_model_dir, "cuda", kv_cache_dtype="fp8")
    assert gpu_runner.cache_dtype == torch.float8_e4m3fn
    gpu = _prompt_logits(gpu_runner, ids)
    exact = _prompt_logits(_runner(tiny_model_dir, "cpu"), ids)
    assert not gpu.isnan().any()
    # a key a float ulp apart on the two devices may round to neighbouring fp8 codes: a looser bound than fp32's
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=2e-3)
    assert (gpu - exact).abs().max() > 10 * (gpu - cpu).abs().max()


def test_auto_dtype_on_cuda_is_half_precision_and_tracks_fp32(tiny_model_dir):
    """auto picks bf16 (fp16 without bf16 support) on CUDA; its logits stay within bf16 rounding of fp32's."""
    runner = _runner(tiny_model_dir, "cuda", "auto")
    assert runner.dtype == (torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16)
    assert runner.model.embed_tokens.weight.dtype == runner.dtype
    ids = load_tokenizer(tiny_model_dir)(PROMPTS[2]).input_ids
    half = _prompt_logits(runner, ids)
    full = _prompt_logits(_runner(tiny_model_dir, "cpu"), ids)
    assert torch.isfinite(half).all()
    err = (half - full).abs().max().item()
    assert err < 0.05 * full.abs().max().item(), err  # bf16 keeps 8 bits: ~0.4 % per op, 2 layers
    agree = (half.argmax(-1) == full.argmax(-1)).float().mean().item()
    assert agree >= 0.8, agree


def test_compressed_factors_on_cuda_give_the_cpu_tokens(artifact, tiny_model_dir):
    from transformers import LlamaForCausalLM

    from server.models.compressed import apply_artifact_to_hf

    runner = _runner(tiny_model_dir, "cuda", compressed=artifact)
    ours = engine_greedy(tiny_model_dir, runner, load_tokenizer(tiny_model_dir), PROMPTS, NEW_TOKENS, MAX_LEN)
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    apply_artifact_to_hf(hf, artifact, tiny_model_dir)
    _assert_greedy_of(hf, load_tokenizer(tiny_model_dir), ours)


def test_recovery_trains_on_cuda_and_serves_there(artifact, tiny_model_dir, tmp_path):
    """Distillation of the factors on the GPU: the loss falls, the manifest records GPU memory, the result serves."""
    import shutil

    art = shutil.copytree(artifact, tmp_path / "art")
    # KL alone: the tiny model's teacher is random, so the default next-token term pulls away from it (the term's
    # CUDA arithmetic is the next test's)
    cfg = RecoveryConfig(objective="distill", train="factors", steps=20, lr=1e-3, seqlen=32, batch_size=4,
                         warmup_steps=2, checkpoint_every=10, device="cuda", ce_weight=0.0)
    block = recover_artifact(art, tiny_model_dir, cfg, data_path=data_dir() / "c4" / "c4-validation-sample.jsonl")
    assert block["final_loss"] < block["initial_loss"], block
    assert block["peak_cuda_mib"] > 0
    assert json.loads((art / "manifest.json").read_text())["recovery"] == block
    tokens = _greedy(tiny_model_dir, "cuda", compressed=art)
    assert all(len(t) == NEW_TOKENS for t in tokens)


def test_distillation_step_on_cuda_matches_the_cpu(artifact, tiny_model_dir):
    """The chunked KL + next-token CE step (the recipe's loss; chunks straddle windows) gives the CPU's KL and
    gradients on CUDA."""
    manifest, tensors = load_artifact(artifact)
    rcfg = RecoveryConfig(objective="distill", train="factors")
    assert rcfg.cross_entropy_weight > 0
    batch = torch.randint(0, len(load_tokenizer(tiny_model_dir)), (2, 48), generator=torch.Generator().manual_seed(0))
    got = {}
    for device in ("cpu", "cuda"):
        model, _ = load_adapted_model(tiny_model_dir, manifest, tensors, rcfg, torch.device(device))
        teacher = load_teacher(tiny_model_dir, torch.device(device))
        kl = distill_backward(model, teacher, batch.to(device), shared_prefix_layers(model, teacher), chunk_tokens=32,
                              ce_weight=rcfg.cross_entropy_weight)
        got[device] = kl, [p.grad.cpu() for p in adapter_parameters(model)]
    # the KL (3e-4 here) is a difference of near-equal log-probabilities near -11: compare it on their scale
    assert got["cuda"][0] == pytest.approx(got["cpu"][0], abs=1e-6)
    assert len(got["cpu"][1]) == len(got["cuda"][1]) > 0
    for cpu, gpu in zip(got["cpu"][1], got["cuda"][1], strict=True):
        torch.testing.assert_close(gpu, cpu, rtol=1e-3, atol=1e-3 * cpu.abs().max().item())


def test_served_on_cuda_with_the_engine_process_answers_like_the_cpu(tiny_model_dir):
    """`neuronmm serve`'s layout (engine core in a spawned process) on device cuda: same greedy text as on CPU."""
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    texts = {}
    for device in ("cpu", "cuda"):
        cfg = Config.model_validate({**tiny_config(tiny_model_dir).model_dump(), "device": device})
        with live_server(cfg, engine_process=True, ready_timeout=120) as srv:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["usage"]["completion_tokens"] == 12
            texts[device] = out["choices"][0]["text"]
    assert texts["cuda"] == texts["cpu"]
