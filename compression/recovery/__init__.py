"""LoRA recovery of compressed low-rank factors (merged back into plain A, B)."""

from compression.recovery.recover import recover_artifact
from compression.recovery.train import RecoveryConfig

__all__ = ["RecoveryConfig", "recover_artifact"]
