"""`server.chat_template`: the tokenizer's own template, one bundled with the server (templates/NAME.jinja) or a file.

Free of the server's heavy imports: `neuronmm serve` reads the template before it spawns the engine core.
"""

from __future__ import annotations

from pathlib import Path

from server.config import ConfigError

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"


def load_chat_template(value: str | None) -> str | None:
    """server.chat_template: None (the tokenizer's own), a bundled name (templates/NAME.jinja) or a file."""
    if value is None:
        return None
    path = TEMPLATES_DIR / f"{value}.jinja" if (TEMPLATES_DIR / f"{value}.jinja").is_file() else Path(value)
    if not path.expanduser().is_file():
        bundled = ", ".join(sorted(p.stem for p in TEMPLATES_DIR.glob("*.jinja")))
        raise ConfigError(f"server.chat_template: no file {value} (bundled templates: {bundled})")
    return path.expanduser().read_text()
