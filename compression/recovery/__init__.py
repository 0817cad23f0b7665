"""Recovery of compressed low-rank factors (LoRA merged back into plain A, B, or the factors themselves; next-token
or distillation loss); settings: server.config.RecoveryConfig."""

from compression.recovery.recover import recover_artifact

__all__ = ["recover_artifact"]
