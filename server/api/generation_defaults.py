"""The model's sampling defaults (vLLM's --generation-config): the request fields a generation_config.json fills in.

Free of torch: `neuronmm serve` reads and checks a folder given on the command line before it spawns the engine
core, so that a wrong one costs no model load.
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import ValidationError

from server.api.protocol import CompletionRequest
from server.config import ConfigError

# generation_config.json's sampling keys -> the request fields they default (vLLM reads the same ones)
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(model_dir: Path, setting: str) -> dict:
    """Request-field defaults from a generation_config.json, as vLLM's --generation-config reads them.

    setting: auto, the model folder's file; vllm, none (the API's own defaults); else a folder holding one.
    """
    if setting == "vllm":
        return {}
    folder = model_dir if setting == "auto" else Path(setting).expanduser()
    path = folder / "generation_config.json"
    if not path.is_file():
        if setting != "auto":
            raise ConfigError(f"model.generation_config: no generation_config.json in {folder}")
        return {}
    try:
        found = json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"model.generation_config: {path} is not JSON ({exc})") from None
    return {field: found[key] for key, field in _SAMPLING_KEYS.items() if found.get(key) is not None}


def check_sampling_defaults(defaults: dict) -> dict:
    """`defaults`, checked as a request's fields are (ConfigError, one line, for a value no request could take)."""
    if defaults:
        try:
            CompletionRequest.model_validate({"prompt": "x", **defaults})
        except ValidationError as exc:
            raise ConfigError(f"model.generation_config: {exc.errors()[0]['loc'][0]}: {exc.errors()[0]['msg']} "
                              "(--generation-config vllm ignores the model's file)") from None
    return defaults
