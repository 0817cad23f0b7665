"""Config -> transformers-neuronx argument translation (pure; no SDK needed)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest

from server.backends.neuron.translate import build_tnx_config, translate
from server.config import ConfigError, load_config

LLAMA_1B = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "max_position_embeddings": 131072, "vocab_size": 128256}


def _cfg(**overrides):
    return load_config("configs/llama-3.2-1b-trn1.yaml", overrides)


def test_trn1_config_translates_to_tnx_kwargs():
    args = translate(_cfg(), LLAMA_1B)
    assert args.model_kwargs == {"tp_degree": 2, "amp": "bf16", "batch_size": 8,
                                 "n_positions": [128, 512, 1024, 2048],
                                 "context_length_estimate": [128, 512, 1024, 2048]}
    assert args.continuous_batching == {"batch_size_for_shared_caches": 8}
    assert args.neuron_config["attention_layout"] == "BSH"
    assert not args.neuron_config["fused_rmsnorm_mlp"] and not args.neuron_config["fuse_mlp"]
    assert args.neuron_config["sequence_parallel_norm"] is False  # the low-rank MLP only all-reduces
    assert args.env["NEURON_COMPILE_CACHE_URL"] == "/data/neuron-compile-cache"


def test_buckets_above_max_model_len_collapse_onto_it():
    args = translate(_cfg(**{"engine.max_model_len": 600}), LLAMA_1B)
    assert args.model_kwargs["n_positions"] == [128, 512, 600]
    assert args.context_buckets == (128, 512, 600)


@pytest.mark.parametrize("overrides, key", [
    ({"engine.max_model_len": 4096}, "neuron.context_buckets"),
    ({"engine.max_num_seqs": 9}, "engine.max_num_seqs"),
    ({"neuron.tp_degree": 3}, "neuron.tp_degree"),
    ({"neuron.tp_degree": 64}, "neuron.tp_degree"),
    ({"neuron.amp": "f32"}, "neuron.amp"),
    ({"neuron.context_buckets": [512, 128, 2048]}, "neuron.context_buckets"),
    ({"neuron.batch_buckets": []}, "neuron.batch_buckets"),
])
def test_bad_settings_name_their_key(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        translate(_cfg(**overrides), LLAMA_1B)


def test_tp_must_divide_heads():
    with pytest.raises(ConfigError, match="does not divide the model's 24 attention heads"):
        translate(_cfg(**{"neuron.tp_degree": 16}), {**LLAMA_1B, "num_attention_heads": 24})


def test_only_llama_compiles_for_neuron():
    assert translate(_cfg(), {**LLAMA_1B, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="compiles Llama models.*not Qwen3ForCausalLM.*backend: torch"):
        translate(_cfg(), {**LLAMA_1B, "architectures": ["Qwen3ForCausalLM"]})


def test_max_model_len_beyond_model_positions():
    with pytest.raises(ConfigError, match="max_position_embeddings 1024"):
        translate(_cfg(), {**LLAMA_1B, "max_position_embeddings": 1024})


def test_build_tnx_config_nests_continuous_batching():
    made = []

    def recorder(kind):
        return lambda **kw: made.append((kind, kw)) or (kind, kw)

    module = SimpleNamespace(ContinuousBatchingConfig=recorder("cb"), NeuronConfig=recorder("nc"))
    kind, kwargs = build_tnx_config(translate(_cfg(), LLAMA_1B), module)
    assert made[0] == ("cb", {"batch_size_for_shared_caches": 8})
    assert kind == "nc" and kwargs["continuous_batching"] == made[0] and kwargs["attention_layout"] == "BSH"


@pytest.mark.parametrize("name, tp", [("llama-3.2-1b", 2), ("llama-3.2-3b", 2), ("llama-3.1-8b", 8)])
def test_shipped_trn1_configs_translate(name, tp):
    cfg = load_config(f"configs/{name}-trn1.yaml")
    assert cfg.backend == "neuron" and cfg.compression.keep_ratio == 0.8
    args = translate(cfg, {**LLAMA_1B, "num_attention_heads": 32})
    assert args.model_kwargs["tp_degree"] == tp


class TnxConfigModule:
    """transformers_neuronx.config's two classes with v0.13.0's parameter lists (config.py:73-87, :204-240): an
    unknown keyword fails, as NeuronConfig's `assert len(kwargs) == 0` (:311) and the CB config's (:87) do."""

    class ContinuousBatchingConfig:
        def __init__(self, *, max_num_seqs=None, batch_size_for_shared_caches=None, max_model_len=None,
                     optimized_paged_attention=None, enable_chunked_prefill=None):
            self.batch_size_for_shared_caches = max_num_seqs or batch_size_for_shared_caches

    class NeuronConfig:
        def __init__(self, *, sparse_attn=None, quant=None, kv_cache_quant=None, continuous_batching=None,
                     attention_layout="HSB", collectives_layout="HSB", cache_layout="SBH", padding_side='left',
                     group_query_attention=None, sequence_parallel_norm=False, sequence_parallel_norm_threshold=2048,
                     on_device_embedding=False, on_device_generation=None, all_reduce_dtype=None,
                     cast_logits_dtype='float32', fuse_qkv=False, qkv_tiling=False, weight_tiling=False,
                     mlp_in_weight_tiling_permute_order=(1, 2, 0, 3), mlp_out_weight_tiling_permute_order=(1, 2, 0, 3),
                     log_softmax_scores=False, shard_over_sequence=False, output_all_logits=False,
                     attn_output_transposed=False, fused_rmsnorm_qkv=False, fused_rmsnorm_mlp=False,
                     mlp_out_weight_transpose=False, fuse_mlp=False, is_eagle_target=False, is_eagle_draft=False,
                     has_pre_attention_norm=True, compilation_worker_count=None, duplicate_q_weight_sos=False):
            self.continuous_batching, self.attention_layout = continuous_batching, attention_layout
            self.cache_layout = cache_layout


def _llama_for_sampling(config, *, n_positions=2048, batch_size=1, amp='f32', tp_degree=2,
                        context_length_estimate=None, context_unroll=None, unroll=None, neuron_config=None,
                        prefixed_length=0):  # llama/model.py:34-36 (its **kwargs are dropped, so a typo is silent)
    return locals()


def test_tnx_arguments_bind_to_the_real_signatures_and_pass_from_pretrained_checks():
    args = translate(_cfg(), LLAMA_1B)
    nc = build_tnx_config(args, TnxConfigModule)
    bound = inspect.signature(_llama_for_sampling).bind("config", neuron_config=nc, **args.model_kwargs).arguments
    assert set(args.model_kwargs) <= set(bound) - {"config"}
    # module.py:398-420 (from_pretrained's _sanity_check) with continuous batching and the default SBH cache layout
    assert max(bound["n_positions"]) >= max(bound["context_length_estimate"])
    assert nc.continuous_batching.batch_size_for_shared_caches == bound["batch_size"]
    assert nc.cache_layout == "SBH" and nc.attention_layout == "BSH"
