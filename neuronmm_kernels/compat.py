"""`nki`, `nl`, `nisa` for kernel modules: the real neuronxcc.nki when importable, else our emulator."""

from __future__ import annotations

try:  # PyPI's neuronx-cc / neuronx-cc-stubs are placeholders that raise ImportError
    import neuronxcc.nki as nki
    import neuronxcc.nki.isa as nisa
    import neuronxcc.nki.language as nl

    HAVE_NEURONXCC = True
except ImportError:
    from .emulator import nki, nisa, nl

    HAVE_NEURONXCC = False

__all__ = ["nki", "nl", "nisa", "HAVE_NEURONXCC"]
