"""LoRA recovery of compressed low-rank factors (merged back into plain A, B); settings: server.config.RecoveryConfig."""

from compression.recovery.recover import recover_artifact

__all__ = ["recover_artifact"]
