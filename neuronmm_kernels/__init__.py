"""NKI kernels for low-rank (X·U·V) matmuls and MLPs, a NumPy NKI emulator, and a trn1 cost model."""
