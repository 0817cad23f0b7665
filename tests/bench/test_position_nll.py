"""bench.position_nll: window spread and the per-position buckets."""

from __future__ import annotations

import math

import torch

from bench.position_nll import bucket_rows, markdown, spread_windows


def test_spread_windows_takes_first_last_and_evenly_between():
    windows = torch.arange(10)[:, None].repeat(1, 4)
    assert spread_windows(windows, 4)[:, 0].tolist() == [0, 3, 6, 9]
    assert spread_windows(windows, 50).shape == windows.shape


def test_bucket_rows_ratio_is_exp_of_the_nll_gap_per_bucket():
    dense = torch.zeros(100, dtype=torch.float64)
    comp = torch.cat([torch.full((64,), 0.1, dtype=torch.float64), torch.full((36,), 0.3, dtype=torch.float64)])
    rows = bucket_rows(dense, comp, (0, 64, 256))
    assert [r["positions"] for r in rows] == [[0, 64], [64, 100]]  # the last bucket ends with the window
    assert math.isclose(rows[0]["ratio"], math.exp(0.1)) and math.isclose(rows[1]["ratio"], math.exp(0.3))
    assert math.isclose(rows[1]["dense_ppl"], 1.0)
    assert bucket_rows(dense[:10], comp[:10], (0, 64, 256, 512)) == bucket_rows(dense[:10], comp[:10], (0, 64))


def test_markdown_lists_every_bucket_and_the_whole():
    rows = bucket_rows(torch.zeros(8).double(), torch.full((8,), 0.2).double(), (0, 4, 8))
    report = {"buckets": rows, "dense_ppl": 1.0, "compressed_ppl": math.exp(0.2), "ratio": math.exp(0.2),
              "windows": 2, "windows_total": 9, "seqlen": 9, "compressed": "DIR", "command": "python -m bench.position_nll"}
    lines = markdown(report).splitlines()
    assert lines[2].startswith("| 0-4 | 1.00 | 1.22 | 1.221 |") and lines[4].startswith("| all |")
