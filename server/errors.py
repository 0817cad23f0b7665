"""Error types shared by every layer (server, compression, bench): the one place to import them from."""

from __future__ import annotations

from pydantic import ValidationError


class ConfigError(ValueError):
    """A config, file or flag that cannot be used; the message names the key or path at fault."""


def first_error(exc: ValidationError) -> str:
    """`dotted.key: message` of a pydantic error's first problem (`unknown key` for a forbidden extra)."""
    err = exc.errors()[0]
    key = ".".join(str(p) for p in err["loc"]) or "<root>"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    return f"{key}: {msg}"
