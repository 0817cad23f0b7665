"""The served LoRA adapters as the API sees them (names a request's `model` may use), and vLLM's runtime updates:
POST /v1/load_lora_adapter and /v1/unload_lora_adapter, which load or drop one in the engine between steps."""

from __future__ import annotations

import logging

from server.api.errors import APIError
from server.api.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from server.config import Config
from server.engine.async_engine import EngineDeadError

log = logging.getLogger(__name__)


class LoraAdapters:
    """Adapter name -> PEFT folder: those the config lists, then those loaded or unloaded at run time."""

    def __init__(self, engine, cfg: Config):
        self.engine = engine
        self.paths = dict(cfg.engine.lora_modules)
        self.enabled = cfg.engine.enable_lora
        self.runtime_updates = cfg.server.allow_runtime_lora_updating
        self.model_names = {cfg.model.name, *cfg.server.model_aliases}

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    @property
    def names(self) -> list[str]:
        """The adapters' names, in the order they were configured or loaded."""
        return list(self.paths)

    def _check_updatable(self) -> None:
        if not self.runtime_updates:
            raise APIError(404, "runtime LoRA updates are off (VLLM_ALLOW_RUNTIME_LORA_UPDATING=true or "
                                "server.allow_runtime_lora_updating turns them on)", code="not_found")
        if not self.enabled:
            raise APIError(400, "LoRA adapters are not enabled (--enable-lora)")

    async def load(self, req: LoadLoraAdapterRequest) -> str:
        """Load a folder under a new name (vLLM's answers: a success line, or a 400 naming what is wrong)."""
        self._check_updatable()
        name = req.lora_name
        if name in self.paths:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
        if name in self.model_names:
            raise APIError(400, f"'{name}' is the served model's name", param="lora_name")
        try:
            await self.engine.call("load_lora", name, req.lora_path)
        except ValueError as exc:  # a folder that does not fit (ConfigError), a name loaded meanwhile
            raise APIError(400, str(exc), param="lora_path") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        self.paths[name] = req.lora_path
        log.info("LoRA adapter %s loaded from %s", name, req.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, req: UnloadLoraAdapterRequest) -> str:
        """Drop an adapter no request runs through (404 for an unknown name, 400 while requests use it)."""
        self._check_updatable()
        name = req.lora_name
        if name not in self.paths:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="not_found")
        try:
            await self.engine.call("unload_lora", name)
        except LookupError as exc:
            raise APIError(404, str(exc), param="lora_name", code="not_found") from None
        except ValueError as exc:  # requests still run through it
            raise APIError(400, str(exc), param="lora_name") from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
        del self.paths[name]
        log.info("LoRA adapter %s unloaded", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
