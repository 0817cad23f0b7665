"""NKI kernels for low-rank (X·U·V) matmuls and MLPs, a NumPy NKI emulator, and a trn1 cost model.

Entry points:
- kernels.lowrank_mlp.lowrank_mlp, kernels.lowrank_matmul.lowrank_matmul, kernels.dense_matmul.dense_matmul
  (NKI sources; compat.py gives them the real neuronxcc.nki or the emulator);
- emulator.run(kernel, *numpy_arrays, trace_only=False, **kwargs) -> (outputs, trace);
- reference: NumPy golden versions of every kernel;
- cost_model.model_lowrank_mlp(num_tokens, hidden, intermediate, ranks) -> ModeledTime (modeled trn1 µs);
- tiling.select_tiles(kind, num_tokens, *dims) -> kernel block sizes (cached per shape).
"""
