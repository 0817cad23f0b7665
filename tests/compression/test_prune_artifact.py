"""`neuronmm compress --method prune` on the tiny model: the artifact, its checks, serving it, recovering it."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from compression.cli import settings_from
from compression.compress import CompressSettings
from compression.evaluation.corpora import C4_EVAL_DOCUMENTS
from compression.prune_artifact import prune_compress_model
from server.backends.torch_runner import TorchRunner
from server.cli import main as cli_main
from server.config import RecoveryConfig, load_config
from server.errors import ConfigError
from server.models.artifact import FACTORS, MANIFEST, load_artifact
from server.models.compressed import apply_artifact_to_hf
from server.runtime import load_tokenizer
from support import engine_greedy

BLOCK = 32  # the tiny model's intermediate 128 = 4 blocks


def _settings(**kw) -> CompressSettings:
    base = dict(method="prune", keep_ratio=0.5, rank_multiple=BLOCK, calib_samples=4, calib_seqlen=32, batch_size=2)
    return CompressSettings(**{**base, **kw})


@pytest.fixture(scope="module")
def pruned(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("prune") / "tiny-prune"
    return out, prune_compress_model(tiny_model_dir, _settings(), out, model_id="tiny")


def _hf(model_dir, artifact=None):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if artifact is not None:
        apply_artifact_to_hf(model, artifact, model_dir)
    return model


def test_refit_is_on_by_default_for_prune_only():
    assert _settings().refit is True
    assert CompressSettings().refit is False
    assert _settings(refit=False).refit is False


def test_manifest_records_block_aligned_widths_within_budget(pruned, tiny_model_dir):
    out, manifest = pruned
    loaded, tensors = load_artifact(out)
    assert loaded == manifest and manifest.method == "prune" and not manifest.low_rank_modules()
    sizes = manifest.allocation["intermediate_sizes"]
    assert len(sizes) == 2 and all(s % BLOCK == 0 and 0 < s <= 128 for s in sizes)
    counts = manifest.parameters
    assert counts.mlp_after <= 0.5 * counts.mlp_before and counts.model_after < counts.model_before
    for name in manifest.pruned_modules():
        layer, proj = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
        out_f, in_f = manifest.modules[name].pruned_shape
        assert (out_f if proj != "down_proj" else in_f) == sizes[layer]
        assert tuple(tensors[f"{name}.weight"].shape) == (out_f, in_f)
    refit = manifest.refit
    assert refit["enabled"] and refit["mean_rel_error_after"] < refit["mean_rel_error_before"]
    dense_params = sum(p.numel() for p in _hf(tiny_model_dir).parameters())
    assert dense_params == counts.model_before
    assert sum(p.numel() for p in _hf(tiny_model_dir, out).parameters()) == counts.model_after
    # calibrated on none of the C4 documents `neuronmm eval` scores
    assert manifest.calibration.excluded_documents == C4_EVAL_DOCUMENTS
    assert min(manifest.calibration.document_ids) >= C4_EVAL_DOCUMENTS


def _engine_greedy(model_dir, artifact, dtype: str, fused: bool, prompts: list[str], new_tokens: int):
    tok = load_tokenizer(model_dir)
    runner = TorchRunner(model_dir, 128, dtype, compressed=artifact, fused_kernels=fused)
    runner.load()
    return tok, engine_greedy(model_dir, runner, tok, prompts, new_tokens, 128)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "reference"])
def test_served_pruned_model_greedy_equals_hf_pruned(pruned, tiny_model_dir, fused):
    out, _ = pruned
    prompts = ["Hello there", "The capital of France is"]
    tok, ours = _engine_greedy(tiny_model_dir, out, "float32", fused, prompts, 12)
    hf, dense = _hf(tiny_model_dir, out), _hf(tiny_model_dir)
    differs = False
    for prompt, tokens in zip(prompts, ours):
        ids = tok(prompt).input_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1]
            differs |= not torch.allclose(logits, dense(torch.tensor([ids + tokens])).logits[0, len(ids) - 1:-1])
        chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
        assert torch.all(logits.max(-1).values - chosen <= 1e-4), prompt
    assert differs  # the pruned model is a different model, or the comparison proves nothing


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_weight_shape_not_matching_the_manifest_is_a_clear_error(pruned, tmp_path):
    art = _copy(pruned[0], tmp_path / "bad")
    tensors = load_file(str(art / FACTORS))
    key = next(k for k in tensors if k.endswith("gate_proj.weight"))
    tensors[key] = tensors[key][:-BLOCK]
    save_file(tensors, str(art / FACTORS))
    with pytest.raises(ConfigError, match="does not match the manifest's pruned_shape"):
        load_artifact(art)


def test_mlp_widths_that_do_not_chain_are_a_clear_error(pruned, tmp_path, tiny_model_dir):
    art = _copy(pruned[0], tmp_path / "bad")
    manifest = json.loads((art / MANIFEST).read_text())
    tensors = load_file(str(art / FACTORS))
    name = next(k for k in manifest["modules"] if k.endswith("up_proj") and manifest["modules"][k].get("pruned_shape"))
    width, hidden = manifest["modules"][name]["pruned_shape"]
    manifest["modules"][name]["pruned_shape"] = [width - BLOCK, hidden]
    tensors[f"{name}.weight"] = tensors[f"{name}.weight"][:width - BLOCK].contiguous()
    (art / MANIFEST).write_text(json.dumps(manifest))
    save_file(tensors, str(art / FACTORS))
    with pytest.raises(ConfigError, match="disagree on the intermediate width"):
        _hf(tiny_model_dir, art)


def test_recover_distill_trains_the_pruned_weights_and_keeps_their_shapes(pruned, tmp_path, tiny_model_dir):
    from compression.recovery import recover_artifact

    src, manifest = pruned
    before = load_artifact(src)[1]
    cfg = RecoveryConfig(objective="distill", train="factors", steps=4, lr=1e-3, seqlen=32, batch_size=2,
                         warmup_steps=1, checkpoint_every=2, num_threads=2, device="cpu")
    block = recover_artifact(src, tiny_model_dir, cfg, out_dir=tmp_path / "rec")
    loaded, after = load_artifact(tmp_path / "rec")
    assert block["method"] == "distill-kl/full-factors" and loaded.recovery["steps"] == 4
    assert set(after) == set(before)
    assert all(after[k].shape == before[k].shape for k in before)
    assert any(not torch.equal(after[k], before[k]) for k in before)
    lora = cfg.model_copy(update={"train": "lora"})
    recover_artifact(src, tiny_model_dir, lora, out_dir=tmp_path / "lora")
    merged = load_artifact(tmp_path / "lora")[1]
    assert all(merged[k].shape == before[k].shape for k in before)


@pytest.mark.parametrize("flags,needle", [
    (["--targets", "mlp+attn"], "--targets mlp"),
    (["--allocation", "measured"], "--allocation measured"),
    (["--latency-model", "trn1"], "no --latency-model"),
    (["--sensitivity-cache", "/tmp/x.json"], "--sensitivity-cache"),
])
def test_prune_settings_it_cannot_honour_fail_in_one_line(flags, needle, tmp_path, capsys):
    code = cli_main(["compress", "--method", "prune", *flags, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and needle in err and len(err.splitlines()) == 1
    assert not (tmp_path / "x").exists()


def test_block_that_does_not_divide_the_intermediate_size_is_a_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="not a multiple"):
        prune_compress_model(tiny_model_dir, _settings(rank_multiple=48), tmp_path / "x", model_id="tiny")
    assert not (tmp_path / "x").exists()


def test_method_prune_comes_from_the_flag():
    import argparse

    args = argparse.Namespace(method="prune", prune_order="energy", keep_ratio=None, sensitivity_cache=None)
    s = settings_from(args, load_config())
    assert (s.method, s.prune_order, s.refit) == ("prune", "energy", True)
