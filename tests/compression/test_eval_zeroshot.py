"""Zero-shot scoring: harness tokenization, log-likelihoods equal a plain full forward, forced answers win."""

from __future__ import annotations

import pytest
import torch

from compression.evaluation import zeroshot
from compression.evaluation.tasks import MCItem, TaskSpec


@pytest.fixture(scope="module")
def tokenizer(smol_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smol_dir)


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _forced_model(vocab_size: int, token_id: int):
    """A real Llama whose every position predicts `token_id` with probability ~1 - 1e-4."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        # Same embedding for every token and no residual updates: the final hidden state is constant.
        model.model.embed_tokens.weight.copy_(torch.linspace(-1, 1, 32).expand(vocab_size, 32))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        normed = model.model.norm(model.model.embed_tokens.weight[:1])[0]
        model.lm_head.weight.zero_()
        model.lm_head.weight[token_id] = 20 * normed / normed.dot(normed)
    return model


def _reference_ll(model, ctx: list[int], cont: list[int]) -> float:
    with torch.inference_mode():
        logp = torch.log_softmax(model(input_ids=torch.tensor([ctx + cont])).logits[0].float(), dim=-1)
    return sum(float(logp[len(ctx) - 1 + i, tok]) for i, tok in enumerate(cont))


def test_encode_pair_moves_trailing_space_and_splits_whole(tokenizer):
    ctx, cont = zeroshot.encode_pair(tokenizer, "Question: 2+2?\nAnswer: ", "4")
    assert tokenizer.decode(ctx) == "Question: 2+2?\nAnswer:"
    assert tokenizer.decode(cont) == " 4"
    assert ctx + cont == tokenizer("Question: 2+2?\nAnswer: 4", add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("requests", [
    [("The cat sat on the", " mat."), ("The cat sat on the", " moon and stayed there."), ("The cat sat on the", " x")],
    [("Sarah was better than Maria so Sarah", " won."), ("Sarah was better than Maria so Maria", " won.")],
])
def test_batched_loglikelihoods_equal_a_plain_forward(tiny_model, tokenizer, requests):
    pairs = [zeroshot.encode_pair(tokenizer, c, x) for c, x in requests]
    got = zeroshot.loglikelihoods(tiny_model, pairs)
    want = [_reference_ll(tiny_model, ctx, cont) for ctx, cont in pairs]
    assert got == pytest.approx(want, abs=1e-3)


def test_forced_answer_is_chosen(tokenizer):
    yes = tokenizer(" yes", add_special_tokens=False)["input_ids"]
    assert len(yes) == 1
    model = _forced_model(len(tokenizer), yes[0])
    items = [
        MCItem((("Is it?", " no"), ("Is it?", " yes")), 1, ("no", "yes")),
        MCItem((("Is it?", " yes yes"), ("Is it?", " no no")), 0, ("yes yes", "no no")),
        MCItem((("Say no", " no"), ("Say yes", " yes")), 1, ("no", "yes")),
    ]
    for item in items:
        lls = zeroshot.loglikelihoods(model, [zeroshot.encode_pair(tokenizer, c, x) for c, x in item.requests])
        assert lls[item.gold] > -0.01 and min(lls) < -10
    spec = TaskSpec("forced", lambda: items, has_acc_norm=True)
    result = zeroshot.evaluate_task(model, tokenizer, spec)
    assert (result.num_items, result.acc, result.acc_norm) == (3, 1.0, 1.0)


def test_acc_norm_divides_by_characters():
    # Raw log-likelihood favours the short choice; per character the long one wins.
    assert zeroshot.predictions([-10.0, -12.0], ("cat", "a much longer answer")) == (0, 1)
    assert zeroshot.predictions([-3.0, -2.0], ("aa", "bb")) == (1, 1)


def test_standard_errors_are_the_harness_mean_stderr_of_the_outcomes(tokenizer):
    """lm-evaluation-harness reports stdev(outcomes, ddof=1) / sqrt(n) for acc and acc_norm; so must we."""
    import math
    import statistics

    yes = tokenizer(" yes", add_special_tokens=False)["input_ids"][0]
    model = _forced_model(len(tokenizer), yes)  # always answers " yes"
    golds = [1, 1, 0, 1, 0]
    items = [MCItem((("Is it?", " no"), ("Is it?", " yes")), g, ("no", "yes")) for g in golds]
    result = zeroshot.evaluate_task(model, tokenizer, TaskSpec("forced", lambda: items, has_acc_norm=True))
    outcomes = [float(g == 1) for g in golds]
    harness = statistics.stdev(outcomes) / math.sqrt(len(outcomes))
    assert result.acc == pytest.approx(0.6) and result.acc_stderr == pytest.approx(harness, rel=1e-12)
    assert result.acc_norm_stderr == pytest.approx(harness, rel=1e-12)
    assert harness != pytest.approx(math.sqrt(0.6 * 0.4 / 5))  # the population form would differ
