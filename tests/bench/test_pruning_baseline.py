"""bench.pruning_baseline: variant names and the results table."""

from __future__ import annotations

import pytest

from bench.pruning_baseline import SVD_DEFAULT, markdown, parse_variant
from server.errors import ConfigError


def test_parse_variant():
    assert parse_variant("global-obs-fisher+refit") == {"name": "global-obs-fisher+refit", "allocation": "global",
                                                        "score": "obs", "fisher": True, "refit": True}
    assert parse_variant("uniform-energy") == {"name": "uniform-energy", "allocation": "uniform", "score": "energy",
                                               "fisher": False, "refit": False}
    for bad in ("global", "global-energy+ls", "greedy-energy", "global-energy-fisher-x", "uniform-l2"):
        with pytest.raises(ConfigError, match="--variants: cannot read"):
            parse_variant(bad)


def test_markdown_rows_compare_with_svd():
    svd = SVD_DEFAULT["ppl"]
    result = {"mlp_params_dense": 1000, "svd_default_quoted": SVD_DEFAULT, "prepass_wall_s": {"obs order": 12.0},
              "rows": [{"label": "dense", "params": 2000, "mlp_params": 1000, "ppl": {"wikitext2": 29.0},
                        "eval_wall_s": 5.0},
                       {"label": "prune global-energy", "variant": parse_variant("global-energy"), "params": 1800,
                        "mlp_params": 800, "ppl": {c: v / 2 for c, v in svd.items()}, "prune_wall_s": 1.0,
                        "eval_wall_s": 6.0, "plan": {"intermediate_sizes": [1536, 1280]}}]}
    lines = markdown(result).splitlines()
    assert lines[2].startswith("| dense | 0.00 M | 100.00 % | 29.00 | – | – | – |")
    assert "| 80.00 % |" in lines[3] and "-50.0 % / -50.0 % / -50.0 %" in lines[3]
    assert "obs order 12 s" in markdown(result)
    assert lines[-1] == "- prune global-energy: 1536 1280"


def test_markdown_compares_with_the_quoted_svd_only_at_its_window_length():
    row = {"label": "prune global-energy", "variant": parse_variant("global-energy"), "params": 1800,
           "mlp_params": 800, "ppl": {"wikitext2": 30.0}, "prune_wall_s": 1.0, "eval_wall_s": 6.0}
    base = {"mlp_params_dense": 1000, "svd_default_quoted": SVD_DEFAULT, "rows": [row]}
    at_512 = markdown({**base, "eval": {"seqlen": 512}}).splitlines()[2]
    at_2048 = markdown({**base, "eval": {"seqlen": 2048}}).splitlines()[2]
    assert f"{100 * (30.0 / SVD_DEFAULT['ppl']['wikitext2'] - 1):+.1f} %" in at_512
    assert "| 30.00 | – | – | – | 1 | 6 |" in at_2048
