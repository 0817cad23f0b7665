"""NKI kernel sources (@nki.jit from compat: the real compiler or the emulator)."""
