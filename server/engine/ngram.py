"""Prompt-lookup drafts: the tokens that followed the sequence's newest n-gram where it last occurred before.

Text that repeats its prompt or itself (summaries, edits of code or documents, extraction, lists) then gets several
tokens a step: the model checks the draft in one forward, whose cost at small batches is the weights it streams,
much as one token's.
"""

from __future__ import annotations

import numpy as np


def propose(tokens: list[int], num_draft: int, lookup_max: int, lookup_min: int) -> list[int]:
    """Up to `num_draft` tokens that followed the latest earlier occurrence of the longest tail n-gram
    (n from lookup_max down to lookup_min) of `tokens`; [] when no tail n-gram occurred before."""
    ids = np.asarray(tokens, dtype=np.int64)
    for n in range(min(lookup_max, len(ids) - 1), lookup_min - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # every n-gram but the tail itself
        starts = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n
            return ids[follow:follow + num_draft].tolist()
    return []
