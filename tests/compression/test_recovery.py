"""Recovery (LoRA or whole factors; next-token or distillation): merge exactness, exact resume, loss goes down,
only the factors change, manifest, serving the result, CLI errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from compression.recovery import recover_artifact
from compression.recovery.adapter import adapter_parameters, merge_adapters, prepare_training
from compression.recovery.checkpoint import CHECKPOINT_NAME
from compression.recovery.data import batch_indices
from compression.recovery.distill import (TeacherCache, distill_backward, hidden_state_loss, kl_per_token,
                                         shared_prefix_layers, teacher_log_probs, teacher_states)
from compression.recovery.recover import _objective_record, load_teacher
import compression.recovery.train as train_module
from compression.recovery.train import lr_factor, train_adapters
from server.config import DISTILL_CE_WEIGHT, RecoveryConfig, data_dir
from server.errors import ConfigError
from server.models.artifact import (FORMAT_VERSION, Manifest, ModuleRecord, SourceRecord, load_artifact, save_artifact,
                                    weights_sha256)
from server.models.compressed import swap_in_artifact
from server.models.loader import load_llama
from server.models.lowrank import LowRankLinear

C4 = data_dir() / "c4" / "c4-validation-sample.jsonl"
needs_c4 = pytest.mark.skipif(not C4.is_file(), reason="shared C4 sample not present")
RANK = 16


def _factorize(model_dir: Path) -> dict[str, torch.Tensor]:
    """Plain rank-RANK SVD factors of every MLP matrix of the tiny model (an artifact's tensors)."""
    weights = load_file(str(model_dir / "model.safetensors"))
    out = {}
    for key, w in weights.items():
        if ".mlp." in key and key.endswith(".weight"):
            U, S, Vh = torch.linalg.svd(w.double(), full_matrices=False)
            name = key[: -len(".weight")]
            out[f"{name}.A"] = (S[:RANK].sqrt()[:, None] * Vh[:RANK]).float().contiguous()
            out[f"{name}.B"] = (U[:, :RANK] * S[:RANK].sqrt()).float().contiguous()
    return out


def _manifest(model_dir: Path, tensors: dict[str, torch.Tensor]) -> Manifest:
    """A hand-made artifact's manifest (no calibration record: recovery then excludes no documents)."""
    modules = {key[:-2]: ModuleRecord(rank=RANK, in_features=a.shape[1], out_features=tensors[key[:-2] + ".B"].shape[0])
               for key, a in tensors.items() if key.endswith(".A")}
    return Manifest(format_version=FORMAT_VERSION, modules=modules, keep_ratio=0.5, method="plain",
                    source=SourceRecord(sha256=weights_sha256(model_dir)))


@pytest.fixture
def artifact(tmp_path, tiny_model_dir) -> Path:
    tensors = _factorize(tiny_model_dir)
    return save_artifact(tmp_path / "art", _manifest(tiny_model_dir, tensors), tensors)


def _tiny_adapted(tiny_model_dir: Path, seed: int = 0, train: str = "lora"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tensors = _factorize(tiny_model_dir)
    swap_in_artifact(model, _manifest(tiny_model_dir, tensors), tensors)
    prepare_training(model, train, adapter_rank=4, alpha=8.0, seed=seed)
    return model


@pytest.fixture
def windows(tiny_model_dir) -> torch.Tensor:
    """12 C4 windows of 32 tokens (recovery text, calibration documents excluded)."""
    from transformers import AutoTokenizer

    from compression.recovery.data import recovery_documents, token_windows

    if not C4.is_file():
        pytest.skip("shared C4 sample not present")
    docs, _, _ = recovery_documents(C4)
    return token_windows(AutoTokenizer.from_pretrained(tiny_model_dir), docs[:40], 32, max_windows=12)


def _small_cfg(**kw) -> RecoveryConfig:
    base = dict(steps=6, lr=1e-2, seqlen=32, batch_size=2, adapter_rank=4, alpha=8.0, warmup_steps=2,
                checkpoint_every=3, num_threads=2, device="cpu")
    base.update(kw)
    return RecoveryConfig(**base)


def test_merged_adapters_reproduce_adapted_outputs(tiny_model_dir):
    torch.manual_seed(1)
    model = _tiny_adapted(tiny_model_dir)
    for p in adapter_parameters(model):  # nonzero updates on both factors, or the test proves nothing
        p.data.normal_(0, 0.05)
    ids = torch.randint(0, 1000, (2, 12))
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    base = {n: (m.base.A.clone(), m.base.B.clone()) for n, m in model.named_modules() if hasattr(m, "lora_A")}
    merged = merge_adapters(model)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert set(merged) == set(base) and len(merged) == 6
    for name, mod in merged.items():
        assert isinstance(mod, LowRankLinear)
        assert mod.A.shape == base[name][0].shape and mod.B.shape == base[name][1].shape
        assert not torch.equal(mod.A, base[name][0])
    torch.testing.assert_close(after, adapted, rtol=1e-4, atol=1e-4)
    assert not adapter_parameters(model)


def test_schedule_and_batches_are_deterministic():
    cfg = _small_cfg(steps=20, warmup_steps=4)
    assert lr_factor(0, cfg) == pytest.approx(0.25) and lr_factor(4, cfg) == pytest.approx(1.0)
    assert lr_factor(19, cfg) < 0.2 and lr_factor(19, cfg) >= cfg.min_lr_ratio
    assert torch.equal(batch_indices(7, 10, 3, 0), batch_indices(7, 10, 3, 0))
    epoch0 = torch.cat([batch_indices(s, 10, 3, 0) for s in range(3)])
    assert len(set(epoch0.tolist())) == 9  # no window repeats within an epoch


@pytest.mark.parametrize("objective, train", [("next_token", "lora"), ("distill", "lora"), ("distill", "factors")])
def test_resume_reproduces_uninterrupted_run(objective, train, tmp_path, tiny_model_dir, windows):
    cfg = _small_cfg(objective=objective, train=train, lr=1e-3 if train == "factors" else 1e-2)
    teacher = load_teacher(tiny_model_dir, torch.device("cpu")) if objective == "distill" else None
    full = _tiny_adapted(tiny_model_dir, train=train)
    run_full = train_adapters(full, windows, cfg, tmp_path / "a" / CHECKPOINT_NAME, teacher=teacher)
    part = _tiny_adapted(tiny_model_dir, train=train)
    first = train_adapters(part, windows, cfg, tmp_path / "b" / CHECKPOINT_NAME, stop_after=4, teacher=teacher)
    assert not first["completed"] and len(first["losses"]) == 4
    resumed = _tiny_adapted(tiny_model_dir, train=train)  # fresh process stand-in: new model, state only from disk
    run_res = train_adapters(resumed, windows, cfg, tmp_path / "b" / CHECKPOINT_NAME, resume=True, teacher=teacher)
    assert run_res["resumed_from"] == 4 and run_res["completed"]
    assert run_res["losses"] == pytest.approx(run_full["losses"], rel=1e-5)
    for a, b in zip(adapter_parameters(full), adapter_parameters(resumed), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_c4
def test_recovery_lowers_loss_and_records_manifest(artifact, tiny_model_dir):
    before = load_file(str(artifact / "factors.safetensors"))
    block = recover_artifact(artifact, tiny_model_dir, _small_cfg(steps=30, batch_size=4, checkpoint_every=10),
                             data_path=C4)
    manifest = json.loads((artifact / "manifest.json").read_text())
    after = load_file(str(artifact / "factors.safetensors"))
    assert manifest["method"] == "plain" and manifest["recovery"] == block
    for key in ("steps", "tokens", "lr", "schedule", "final_loss", "data_sha256", "adapter_rank", "wall_s",
                "module_rel_error"):
        assert key in block
    assert block["steps"] == 30 and block["tokens"] == 30 * 4 * 32 and len(block["data_sha256"]) == 64
    assert block["final_loss"] < block["initial_loss"] - 0.05  # random init: ~10.81 -> ~10.71 measured
    assert set(after) == set(before) and all(after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    assert not (artifact / CHECKPOINT_NAME).exists()
    assert [p.name for p in artifact.parent.iterdir() if p.name.startswith(".")] == []


@needs_c4
def test_interrupted_recovery_leaves_artifact_untouched(artifact, tiny_model_dir):
    before = (artifact / "factors.safetensors").read_bytes()
    assert recover_artifact(artifact, tiny_model_dir, _small_cfg(), data_path=C4, stop_after=2) == {}
    assert (artifact / "factors.safetensors").read_bytes() == before
    assert "recovery" not in json.loads((artifact / "manifest.json").read_text())
    assert (artifact / CHECKPOINT_NAME).is_file()
    block = recover_artifact(artifact, tiny_model_dir, _small_cfg(), data_path=C4, resume=True)
    assert block["steps"] == 6 and "recovery" in json.loads((artifact / "manifest.json").read_text())


@needs_c4
def test_recovery_text_excludes_calibration_documents(tiny_model_dir):
    from transformers import AutoTokenizer

    from compression.calibration import calibration_windows
    from compression.recovery.data import read_documents, recovery_documents

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    calib = calibration_windows(C4, tok, 4, 64, 3)
    rest, _, excluded = recovery_documents(C4, set(calib.document_ids))
    everything, _ = read_documents(C4)
    assert excluded >= 1 and len(rest) == len(everything) - excluded
    used = [d for d in everything if d not in set(rest)]
    used_ids = torch.cat([torch.tensor(tok(d, add_special_tokens=False)["input_ids"]) for d in used])
    # every calibration token sequence starts inside an excluded document, none inside a kept one
    first = calib.windows[0, :16].tolist()
    assert any(first == used_ids[i:i + 16].tolist() for i in range(len(used_ids) - 15))
    for doc in rest[:200]:
        assert doc[:40] not in tok.decode(calib.windows.flatten().tolist())


@pytest.mark.parametrize("argv, needle", [
    (["--artifact", "/nonexistent/art"], "no such directory"),
    (["--artifact", "{art}", "--steps", "0"], "steps must be >= 1"),
    (["--artifact", "{art}", "--lr", "-1"], "lr must be a positive"),
    (["--artifact", "{tmp}"], "not a compressed artifact"),
    (["--artifact", "{art}", "--device", "tpu"], "'tpu' is not auto, cpu or cuda[:N]"),
    (["--artifact", "{art}", "--seqlen", "100000"], "exceeds the model's"),
    (["--artifact", "{art}", "--out", "{tmp}/../notes.txt"], "exists and is a file"),
])
def test_bad_arguments_are_one_line_errors(argv, needle, artifact, tmp_path, capsys):
    from server.cli import main

    empty = tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "notes.txt").write_text("precious")
    argv = [a.format(art=artifact, tmp=empty) for a in argv]
    assert main(["recover", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and needle in err and err.startswith("neuronmm recover: error:")


def test_kl_per_token_is_the_mean_over_tokens_of_full_vocabulary_kls():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 3, 11), torch.randn(2, 3, 11)
    teacher_logp = torch.log_softmax(teacher, dim=-1)
    p, log_q = teacher_logp.exp(), torch.log_softmax(student, dim=-1)
    per_token = (p * (teacher_logp - log_q)).sum(-1)  # [2, 3]
    torch.testing.assert_close(kl_per_token(student, teacher_logp), per_token.mean())
    assert kl_per_token(teacher, teacher_logp).abs() < 1e-6


@pytest.mark.parametrize("chunk_tokens", [5, 16, 1000])
def test_chunked_distill_step_matches_the_full_logits_kl_and_its_gradients(tiny_model_dir, windows, chunk_tokens):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    model = _tiny_adapted(tiny_model_dir, train="factors")
    torch.manual_seed(0)
    with torch.no_grad():  # move the student off the teacher so the KL and its gradients are not ~0
        for p in adapter_parameters(model):
            p.add_(torch.randn_like(p) * p.std())
    batch = windows[:2]
    reference = kl_per_token(model(input_ids=batch).logits, teacher_log_probs(teacher, batch))
    reference.backward()
    expected = [p.grad.clone() for p in adapter_parameters(model)]
    model.zero_grad(set_to_none=True)
    loss = distill_backward(model, teacher, batch, chunk_tokens=chunk_tokens)
    assert reference.item() > 1e-3
    assert loss == pytest.approx(reference.item(), rel=1e-4)
    for got, want in zip((p.grad for p in adapter_parameters(model)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_student_starts_after_the_layers_it_shares_with_the_teacher(tiny_model_dir, windows):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    student = load_teacher(tiny_model_dir, torch.device("cpu"))  # layer 0 stays the teacher's; layer 1's MLP trains
    assert shared_prefix_layers(student, teacher) == 1  # every layer equal: the student still runs its last
    torch.manual_seed(0)
    trained = list(student.model.layers[1].mlp.parameters())
    with torch.no_grad():
        for p in trained:
            p.add_(torch.randn_like(p) * p.std()).requires_grad_(True)
    assert shared_prefix_layers(student, teacher) == 1
    batch = windows[:2]
    reference = kl_per_token(student(input_ids=batch).logits, teacher_log_probs(teacher, batch))
    reference.backward()
    expected = [p.grad.clone() for p in trained]
    student.zero_grad(set_to_none=True)
    assert distill_backward(student, teacher, batch, shared_layers=1) == pytest.approx(reference.item(), rel=1e-4)
    for got, want in zip((p.grad for p in trained), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    assert len(student.model.layers) == 2  # the layers are put back after the step
    student.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    assert shared_prefix_layers(student, teacher) == 0  # a trained layer 0 is not shared


def _counting_calls(module: torch.nn.Module) -> list[int]:
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("hidden_loss", [0.0, 2.0])
def test_revisited_windows_read_the_teacher_from_the_cache_and_train_the_same(tmp_path, tiny_model_dir, windows,
                                                                               monkeypatch, hidden_loss):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    calls = _counting_calls(teacher.base_model)
    cfg = _small_cfg(objective="distill", train="factors", lr=1e-3, steps=15, checkpoint_every=5,  # 30 rows, 12 windows
                     hidden_loss=hidden_loss)
    cached = _tiny_adapted(tiny_model_dir, train="factors")
    run = train_adapters(cached, windows, cfg, tmp_path / "a.pt", teacher=teacher)
    assert run["teacher_cache"]["batches_run"] == len(calls) == 6  # the first epoch's six batches, nothing after
    assert run["teacher_cache"]["batches_from_cache"] == 9 and run["teacher_cache"]["mib"] > 0
    calls.clear()
    plain = _tiny_adapted(tiny_model_dir, train="factors")
    reference = train_adapters(plain, windows, cfg, tmp_path / "b.pt", teacher=teacher, cache_teacher=False)
    assert len(calls) == 15 and "teacher_cache" not in reference
    assert run["losses"] == pytest.approx(reference["losses"], rel=1e-5)
    for a, b in zip(adapter_parameters(cached), adapter_parameters(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    if hidden_loss:
        return  # resuming and the cache's limit do not depend on the loss: checked once, without the hidden term
    # interrupted in the second epoch and resumed with an empty cache: the same weights again
    part = _tiny_adapted(tiny_model_dir, train="factors")
    train_adapters(part, windows, cfg, tmp_path / "c.pt", teacher=teacher, stop_after=10)
    train_adapters(part, windows, cfg, tmp_path / "c.pt", teacher=teacher, resume=True)
    for a, b in zip(adapter_parameters(part), adapter_parameters(plain), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(train_module, "TEACHER_CACHE_LIMIT", 1000)  # a cache that would not fit is not made
    over = train_adapters(_tiny_adapted(tiny_model_dir, train="factors"), windows, cfg, tmp_path / "d.pt",
                          teacher=teacher, stop_after=1)
    assert "teacher_cache" not in over


def test_teacher_cache_keeps_the_shared_prefix_state_per_window(tiny_model_dir, windows):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    calls = _counting_calls(teacher.base_model)
    cache = TeacherCache()
    first = cache.states(teacher, windows[[0, 1]], torch.tensor([0, 1]), shared_layers=1)
    again = cache.states(teacher, windows[[1, 0]], torch.tensor([1, 0]), shared_layers=1)  # other batch, same windows
    assert len(calls) == 1 and (cache.hits, cache.misses) == (1, 1)
    fresh = teacher_states(teacher, windows[[1, 0]], shared_layers=1)
    torch.testing.assert_close(again.prefix, fresh.prefix, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(again.final, fresh.final, rtol=1e-5, atol=1e-6)
    assert torch.equal(again.final[1], first.final[0])
    cache.states(teacher, windows[[0, 2]], torch.tensor([0, 2]), shared_layers=1)  # window 2 is new: the teacher runs
    assert len(calls) == 3 and cache.misses == 2  # (one of the three is `fresh` above)
    assert cache.nbytes == 3 * 2 * windows.shape[1] * teacher.config.hidden_size * 4  # prefix and final, 3 windows
    assert cache.nbytes == TeacherCache.bytes_needed(3, windows.shape[1], teacher.config.hidden_size, 2)


def test_hidden_state_loss_compares_directions_per_token():
    torch.manual_seed(0)
    states = tuple(torch.randn(2, 5, 8) for _ in range(3))
    scaled = tuple(s * torch.rand(2, 5, 1).add(0.5) * 100 for s in states)  # every token's state rescaled
    assert hidden_state_loss(states, scaled).item() == pytest.approx(0.0, abs=1e-6)
    other = tuple(torch.randn(2, 5, 8) for _ in range(3))
    assert hidden_state_loss(states, other).item() == pytest.approx(2.0, rel=0.3)  # unit-RMS random pairs: E = 2
    with pytest.raises(ValueError, match="2 student states against 3"):
        hidden_state_loss(states[:2], other)


def test_hidden_state_loss_gradients_match_autograd_of_the_summed_loss(tiny_model_dir, windows):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    model = _tiny_adapted(tiny_model_dir, train="factors")
    batch, weight = windows[:2], 3.0
    out = model(input_ids=batch, output_hidden_states=True)
    with torch.no_grad():
        t_out = teacher(input_ids=batch, output_hidden_states=True)
    hidden = hidden_state_loss(tuple(out.hidden_states[1:-1]), tuple(t_out.hidden_states[1:-1]))
    assert hidden.item() > 1e-4  # the factored MLPs move the states, or the test proves nothing
    kl = kl_per_token(out.logits, F.log_softmax(t_out.logits, dim=-1))
    (kl + weight * hidden).backward()
    expected = [p.grad.clone() for p in adapter_parameters(model)]
    model.zero_grad(set_to_none=True)
    assert distill_backward(model, teacher, batch, hidden_weight=weight) == pytest.approx(kl.item(), rel=1e-4)
    for got, want in zip((p.grad for p in adapter_parameters(model)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


def test_hidden_state_loss_after_a_shared_prefix_compares_the_same_layers():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(config).eval()
    student = copy.deepcopy(teacher)
    for p in [*teacher.parameters(), *student.parameters()]:
        p.requires_grad_(False)
    trained = [p for layer in student.model.layers[1:] for p in layer.mlp.parameters()]
    with torch.no_grad():
        for p in trained:
            p.add_(torch.randn_like(p) * p.std()).requires_grad_(True)
    assert shared_prefix_layers(student, teacher) == 1
    batch, weight = torch.randint(0, 256, (2, 16)), 2.0
    out = student(input_ids=batch, output_hidden_states=True)
    with torch.no_grad():
        t_out = teacher(input_ids=batch, output_hidden_states=True)
    # the state after layer 1, the one unshared layer before the last: index 2 of (embeddings, layer 0, 1, final norm)
    hidden = hidden_state_loss((out.hidden_states[2],), (t_out.hidden_states[2],))
    (kl_per_token(out.logits, F.log_softmax(t_out.logits, dim=-1)) + weight * hidden).backward()
    expected = [p.grad.clone() for p in trained]
    student.zero_grad(set_to_none=True)
    distill_backward(student, teacher, batch, shared_layers=1, hidden_weight=weight)
    for got, want in zip((p.grad for p in trained), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("chunk_tokens", [7, 128])
def test_cross_entropy_term_matches_autograd_of_kl_plus_the_next_token_loss(tiny_model_dir, windows, chunk_tokens):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    model = _tiny_adapted(tiny_model_dir, train="factors")
    batch, weight = windows[:2], 0.5
    out = model(input_ids=batch, labels=batch)
    kl = kl_per_token(out.logits, teacher_log_probs(teacher, batch))
    (kl + weight * out.loss).backward()
    expected = [p.grad.clone() for p in adapter_parameters(model)]
    model.zero_grad(set_to_none=True)
    got_kl = distill_backward(model, teacher, batch, chunk_tokens=chunk_tokens, ce_weight=weight)
    # The reported loss stays the KL (not KL + 0.5 CE, orders of magnitude larger). The KL of a student this close to
    # its teacher is ~3e-4, a sum of differences of log-probabilities near -11, so fp32 rounding alone moves it by a
    # few 1e-8 between the chunked pass and the whole one (3.7e-8 on an AMD EPYC): the gradients' absolute floor.
    assert got_kl == pytest.approx(kl.item(), rel=1e-4, abs=1e-7)
    for got, want in zip((p.grad for p in adapter_parameters(model)), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-7)
    model.zero_grad(set_to_none=True)
    distill_backward(model, teacher, batch, chunk_tokens=chunk_tokens)  # without it the gradients differ
    assert any(not torch.allclose(p.grad, e, rtol=1e-3, atol=1e-6)
               for p, e in zip(adapter_parameters(model), expected, strict=True))


def test_ce_weight_reaches_the_training_step_and_the_manifest(tmp_path, tiny_model_dir, windows):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    runs, models = [], []
    for ce in (0.0, 0.5):
        model = _tiny_adapted(tiny_model_dir, train="factors")
        cfg = _small_cfg(objective="distill", train="factors", lr=1e-3, steps=3, ce_weight=ce)
        runs.append(train_adapters(model, windows, cfg, tmp_path / f"ce{ce}.pt", teacher=teacher))
        models.append(model)
    assert runs[0]["losses"][0] == pytest.approx(runs[1]["losses"][0], rel=1e-6)  # the same KL before any update
    assert any(not torch.allclose(a, b) for a, b in zip(*(adapter_parameters(m) for m in models), strict=True))
    assert "next-token cross-entropy" in _objective_record(_small_cfg(objective="distill", ce_weight=0.5))["loss"]


def test_distillation_adds_the_next_token_loss_by_default():
    assert RecoveryConfig(objective="distill").cross_entropy_weight == DISTILL_CE_WEIGHT > 0
    assert RecoveryConfig(objective="distill", ce_weight=0).cross_entropy_weight == 0  # KL only, on request
    assert RecoveryConfig(objective="next_token").cross_entropy_weight == 0
    assert "next-token cross-entropy" in _objective_record(RecoveryConfig(objective="distill"))["loss"]
    assert RecoveryConfig(objective="distill").fingerprint()["ce_weight"] == DISTILL_CE_WEIGHT  # resume compares it


def test_hidden_loss_needs_distillation():
    with pytest.raises(ValueError, match="hidden_loss needs objective distill"):
        RecoveryConfig(objective="next_token", hidden_loss=1.0)
    with pytest.raises(ValueError, match="ce_weight needs objective distill"):
        RecoveryConfig(objective="next_token", ce_weight=0.5)


def test_distill_loss_decreases(tiny_model_dir, tmp_path, windows):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    model = _tiny_adapted(tiny_model_dir)
    # KL alone: the tiny model's teacher is random, so the default next-token term pulls away from it
    run = train_adapters(model, windows, _small_cfg(objective="distill", steps=10, warmup_steps=1, ce_weight=0.0),
                         tmp_path / "c.pt", teacher=teacher)
    losses = run["losses"]
    assert losses[0] > 0 and sum(losses[-3:]) / 3 < losses[0] * 0.9, losses


def test_train_factors_changes_only_the_factors(tiny_model_dir, tmp_path, windows):
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    model = _tiny_adapted(tiny_model_dir, train="factors")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trained = adapter_parameters(model)
    assert len(trained) == 2 * 6 and not any(".lora_" in n for n, _ in model.named_parameters())
    run = train_adapters(model, windows, _small_cfg(objective="distill", train="factors", lr=1e-3, steps=3),
                         tmp_path / "c.pt", teacher=teacher)
    assert run["completed"] and merge_adapters(model) == {} and not adapter_parameters(model)
    after = model.state_dict()
    factors = {k for k in before if k.endswith((".mlp.gate_proj.A", ".mlp.gate_proj.B", ".mlp.up_proj.A",
                                                ".mlp.up_proj.B", ".mlp.down_proj.A", ".mlp.down_proj.B"))}
    assert len(factors) == 12 and set(after) == set(before)
    assert all(not torch.equal(after[k], before[k]) for k in factors)
    assert all(torch.equal(after[k], before[k]) for k in set(before) - factors)


@needs_c4
@pytest.mark.parametrize("train, method", [("lora", "distill-kl/lora-on-factors"),
                                           ("factors", "distill-kl/full-factors")])
def test_distilled_artifact_records_objective_and_loads_in_the_server(train, method, artifact, tiny_model_dir):
    before = load_file(str(artifact / "factors.safetensors"))
    block = recover_artifact(artifact, tiny_model_dir, _small_cfg(objective="distill", train=train, steps=4, windows=4),
                             data_path=C4)
    recovery = json.loads((artifact / "manifest.json").read_text())["recovery"]
    assert recovery == block
    assert (recovery["num_windows"], recovery["epochs"]) == (4, 2.0)  # 4 steps x 2 rows over 4 windows
    assert recovery["teacher_cache"]["batches_from_cache"] == 2
    assert (recovery["objective"], recovery["train"], recovery["method"]) == ("distill", train, method)
    assert ("adapter_rank" in recovery) == (train == "lora") and recovery["lr"] == pytest.approx(1e-2)
    _, after = load_artifact(artifact)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    served = load_llama(tiny_model_dir, 64, compressed=artifact)
    dense_params = sum(v.numel() for v in load_file(str(tiny_model_dir / "model.safetensors")).values())
    assert sum(p.numel() for p in served.parameters()) < dense_params


def test_default_lr_follows_what_trains():
    assert RecoveryConfig().learning_rate == 1e-3 and RecoveryConfig(train="factors").learning_rate == 1e-4
    assert RecoveryConfig(train="factors", lr=5e-5).learning_rate == 5e-5
    assert RecoveryConfig().fingerprint()["objective"] == "next_token"
    assert RecoveryConfig(objective="distill").fingerprint() != RecoveryConfig().fingerprint()
    assert RecoveryConfig(train="factors").fingerprint() != RecoveryConfig().fingerprint()


def test_resume_with_another_objective_is_refused(tmp_path, tiny_model_dir, windows):
    ckpt = tmp_path / CHECKPOINT_NAME
    train_adapters(_tiny_adapted(tiny_model_dir), windows, _small_cfg(), ckpt, stop_after=1)
    teacher = load_teacher(tiny_model_dir, torch.device("cpu"))
    with pytest.raises(ConfigError, match="other recovery settings"):
        train_adapters(_tiny_adapted(tiny_model_dir), windows, _small_cfg(objective="distill"), ckpt, resume=True,
                       teacher=teacher)


def test_artifact_without_low_rank_modules_is_a_one_line_error(tmp_path, tiny_model_dir, capsys):
    from server.cli import main

    tensors = _factorize(tiny_model_dir)
    manifest = _manifest(tiny_model_dir, tensors)
    dense = {name: rec.model_copy(update={"rank": None, "dense": True, "reason": "test"})
             for name, rec in manifest.modules.items()}
    art = save_artifact(tmp_path / "dense", manifest.model_copy(update={"modules": dense}), {})
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(f"model: {{name: tiny, source: safetensors, path: {tiny_model_dir}}}\n")
    assert main(["recover", "--artifact", str(art), "--config", str(cfg), "--objective", "distill"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no low-rank or pruned modules" in err


def test_recovery_never_trains_on_the_c4_evaluation_split(tmp_path):
    from compression.evaluation.corpora import C4_EVAL_DOCUMENTS
    from compression.calibration import evaluation_documents

    assert evaluation_documents(C4) == set(range(C4_EVAL_DOCUMENTS))
    other = tmp_path / "other.jsonl"
    other.write_text('{"text": "elsewhere"}\n')
    assert evaluation_documents(other) == set()
