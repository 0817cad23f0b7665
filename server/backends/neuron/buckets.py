"""Static-shape buckets: which compiled graph a step runs on, and how many of its slots are padding."""

from __future__ import annotations

import threading
from collections.abc import Sequence


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """Smallest bucket >= n (buckets ascending); ValueError when n exceeds the largest."""
    for b in buckets:
        if n <= b:
            return b
    raise ValueError(f"{n} exceeds the largest compiled bucket {buckets[-1]}")


class PaddingStats:
    """Per (phase, bucket) counts of real and padded slots (tokens for prefill, sequences for decode)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # written by the engine thread, read by /metrics
        self._counts: dict[tuple[str, int], list[int]] = {}

    def record(self, phase: str, bucket: int, real: int) -> None:
        """One graph run: `real` useful slots in a bucket of size `bucket`."""
        if not 0 < real <= bucket:
            raise ValueError(f"{phase}: {real} real slots do not fit bucket {bucket}")
        with self._lock:
            c = self._counts.setdefault((phase, bucket), [0, 0, 0])
            c[0] += 1
            c[1] += real
            c[2] += bucket - real

    def snapshot(self) -> dict[tuple[str, int], dict[str, int]]:
        """{(phase, bucket): {"runs", "real", "padding"}}."""
        with self._lock:
            return {k: {"runs": v[0], "real": v[1], "padding": v[2]} for k, v in self._counts.items()}
