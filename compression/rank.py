"""Block-aligned rank for a keep_ratio of a matrix's parameters, and whether low rank saves anything."""

from __future__ import annotations


def block_rank(in_features: int, out_features: int, keep_ratio: float, rank_multiple: int) -> int:
    """r = round(in·out·keep / ((in+out)·m))·m, at least m: the factors keep ≈ keep_ratio of in·out."""
    if not 0 < keep_ratio <= 1:
        raise ValueError(f"keep_ratio must be in (0, 1], got {keep_ratio}")
    if rank_multiple < 1:
        raise ValueError(f"rank_multiple must be >= 1, got {rank_multiple}")
    ideal = in_features * out_features * keep_ratio / ((in_features + out_features) * rank_multiple)
    return max(rank_multiple, round(ideal) * rank_multiple)


def low_rank_params(in_features: int, out_features: int, rank: int) -> int:
    """Parameters of the two factors A [rank, in] and B [out, rank]."""
    return rank * (in_features + out_features)


def saves_parameters(in_features: int, out_features: int, rank: int) -> bool:
    """True when the factors are strictly smaller than the dense matrix (and the rank is a real truncation)."""
    return rank < min(in_features, out_features) and \
        low_rank_params(in_features, out_features, rank) < in_features * out_features
