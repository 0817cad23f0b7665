"""Block-aligned rank formula: multiples of m, at least m, within half a block of the parameter budget."""

import pytest

from compression.rank import block_rank, low_rank_params, saves_parameters


@pytest.mark.parametrize("in_f,out_f", [(576, 1536), (1536, 576), (4096, 11008), (64, 128)])
@pytest.mark.parametrize("keep", [0.3, 0.6, 0.8, 0.9])
@pytest.mark.parametrize("m", [1, 8, 32, 128])
def test_rank_meets_budget(in_f, out_f, keep, m):
    r = block_rank(in_f, out_f, keep, m)
    assert r % m == 0 and r >= m
    budget = in_f * out_f * keep
    ideal = budget / (in_f + out_f)
    if ideal >= m / 2:  # rounding to the nearest block: off by at most half a block of parameters
        assert abs(low_rank_params(in_f, out_f, r) - budget) <= (in_f + out_f) * m / 2 + 1e-6


def test_smollm2_ranks():
    assert block_rank(576, 1536, 0.8, 128) == 384
    assert block_rank(576, 1536, 0.8, 32) == 320
    assert block_rank(576, 1536, 0.6, 128) == 256


def test_no_saving_means_dense():
    assert not saves_parameters(64, 128, block_rank(64, 128, 1.0, 128))  # rank 128 >= min dim
    assert saves_parameters(576, 1536, 384)
    with pytest.raises(ValueError):
        block_rank(10, 10, 0.0, 1)
