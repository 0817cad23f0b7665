"""Where a LoRA adapter lives: a PEFT folder or a llama.cpp GGUF file.

Free of torch: `neuronmm serve` checks --lora-modules before it spawns the engine core, so that a wrong path costs
no model load.
"""

from __future__ import annotations

from pathlib import Path

from server.errors import ConfigError


def adapter_format(name: str, path: str | Path) -> str:
    """"gguf" for a .gguf file, "peft" for a folder with an adapter_config.json; a one-line ConfigError otherwise."""
    folder = Path(path).expanduser()
    if folder.is_file() and folder.suffix == ".gguf":
        return "gguf"
    if not folder.is_dir():
        raise ConfigError(f"LoRA adapter {name}: {folder} is neither a PEFT folder nor a .gguf file")
    if not (folder / "adapter_config.json").is_file():
        raise ConfigError(f"LoRA adapter {folder}: no adapter_config.json (a PEFT LoRA folder is expected)")
    return "peft"
