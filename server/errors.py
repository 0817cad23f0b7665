"""Error types shared by every layer (server, compression, bench): the one place to import them from."""

from __future__ import annotations

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config, file or flag that cannot be used; the message names the key or path at fault."""


_BOUNDS = {"greater_than_equal": ("ge", ">="), "greater_than": ("gt", ">"), "less_than_equal": ("le", "<="),
           "less_than": ("lt", "<")}


def first_error(exc: ValidationError) -> str:
    """A pydantic error's first problem as `dotted.key: message` (`key must be >= 1, got 0` for a bound)."""
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "<root>"
    if err["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if err["type"] in _BOUNDS:
        name, sign = _BOUNDS[err["type"]]
        bound = err["ctx"][name]
        rule = "a positive number" if (sign, bound) == (">", 0) else f"{sign} {bound}"
        return f"{key} must be {rule}, got {err['input']!r}"
    return f"{key}: {err['msg']}"
