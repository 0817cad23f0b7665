"""NeuronRunner: the ModelRunner protocol over a transformers-neuronx LlamaForSampling (continuous batching).

Each prefill runs as its own context-encoding call (tnx's "virtual dynamic batching": one
sequence at a time, padded by tnx to the smallest context bucket); all decode tokens of a step
run in one call on the compiled decode graph. That graph has one batch size: under continuous
batching tnx pads every decode to `batch_size_for_shared_caches` (tnx v0.13.0 base.py:500 and
575-586 scatter the active rows into a zero batch of that size), so smaller neuron.batch_buckets
are never compiled for decode and the padding reported is against the full batch. The padding rows
are not inert: the decode graph writes the KV cache of every row of that batch, a padding row its
token 0 at position 0 (layers/attention.py:276-294, attention_utils.py:39-63 index rows by iota, not
by seq_ids). So every step runs its one decode call *before* its context encodings (a slot prefilled
first would lose its position 0), and a one-token prompt joins that decode call: tnx sends any
one-token input down the decode path (base.py:503, 703-710), and on its own that call would pad over
every live sequence. The scheduler decodes every live sequence each step, so the padding rows only
land on free slots and on slots whose prompt is encoded right after. Chunked prefills are held back
until the prompt's last chunk arrives, because the context-encoding graph starts at position 0.
Padding per bucket is counted for /metrics.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch

from server.backends.base import SeqChunk
from server.backends.neuron.buckets import PaddingStats, bucket_for
from server.backends.neuron.translate import TnxArgs, build_tnx_config, translate
from server.config import Config, ConfigError
from server.backends.neuron.pruned_checkpoint import write_pruned_checkpoint
from server.models.artifact import load_artifact, read_manifest

log = logging.getLogger(__name__)


def load_factors(compressed: Path, num_layers: int, tp_degree: int) -> dict:
    """Artifact -> {layer: LayerFactors} in the kernel layout (transposed, padded), once at load."""
    import numpy as np

    from server.backends.neuron.layout import compressed_layers, prepare_layer

    _, tensors = load_artifact(compressed)
    tensors = {k: (v.float().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)) for k, v in tensors.items()}
    layers = compressed_layers(tensors, num_layers)
    if not layers:
        raise ConfigError(f"model.compressed: {compressed} has no MLP factors (model.layers.N.mlp.*_proj.A/B)")
    return {i: prepare_layer(tensors, i, tp_degree) for i in layers}


def build_tnx_model(model_dir: Path, args: TnxArgs, factors: dict, hf_config: dict) -> Any:
    """Compile LlamaForSampling for every bucket, with the low-rank MLP patched in (SDK only)."""
    from transformers_neuronx import config as tnx_config
    from transformers_neuronx.llama.model import LlamaForSampling

    from server.backends.neuron import tnx_patch

    state = None
    neuron_config = build_tnx_config(args, tnx_config)
    if factors:
        tnx_patch.check_neuron_config(neuron_config)  # before any weight loads or bucket compiles
        state = tnx_patch.install_into_sdk(factors, hf_config["hidden_size"], hf_config["intermediate_size"])
    try:
        model = LlamaForSampling.from_pretrained(str(model_dir), neuron_config=neuron_config, **args.model_kwargs)
        model.to_neuron()  # loads weights (factor injection happens here) and compiles every bucket
        if state is not None:
            tnx_patch.verify_injection(state, sorted(factors))
    finally:
        if state is not None:
            tnx_patch.uninstall(state)
    return model


class NeuronRunner:
    """Runs engine steps on NeuronCores through a compiled transformers-neuronx model."""

    supports_paged_kv = False  # transformers-neuronx keeps its own cache: a slot per sequence, no sharing

    def __init__(self, cfg: Config, model_dir: Path, compressed: Path | None = None,
                 model_factory: Callable[..., Any] = build_tnx_model):
        self.cfg = cfg
        self.model_dir = Path(model_dir)
        self.compressed = compressed
        self.hf_config = json.loads((self.model_dir / "config.json").read_text())
        self.args = translate(cfg, self.hf_config)
        self.max_model_len = cfg.engine.max_model_len
        self.vocab_size = int(self.hf_config["vocab_size"])
        self.padding = PaddingStats()
        self.model: Any = None
        self._factory = model_factory
        self._pending: dict[int, list[int]] = {}  # slot -> prompt tokens of chunks not yet run
        # the one compiled decode batch: tnx pads every decode step to it (see the module docstring)
        self.decode_batch = int(self.args.continuous_batching["batch_size_for_shared_caches"])

    def load(self) -> None:
        for key, value in self.args.env.items():
            # one compile cache: the SDK's and the one the pruned checkpoints below go into
            if os.environ.get(key, value) != value:
                log.warning("%s=%s in the environment is replaced by the config's %s", key, os.environ[key], value)
            os.environ[key] = value
        Path(self.args.env["NEURON_COMPILE_CACHE_URL"]).mkdir(parents=True, exist_ok=True)
        factors, tnx_dir = {}, self.model_dir
        if self.compressed and read_manifest(self.compressed).pruned_modules():
            # a pruned artifact is a plain Llama with narrower MLPs: tnx compiles it as one, no kernel patch
            tnx_dir = write_pruned_checkpoint(self.model_dir, self.compressed, Path(self.args.env[
                "NEURON_COMPILE_CACHE_URL"]) / "checkpoints", self.cfg.neuron.tp_degree)
        elif self.compressed and self.cfg.neuron.use_lowrank_kernel:
            factors = load_factors(self.compressed, self.hf_config["num_hidden_layers"], self.cfg.neuron.tp_degree)
            log.info("low-rank NKI MLP in %d of %d layers", len(factors), self.hf_config["num_hidden_layers"])
        elif self.compressed:
            raise ConfigError("neuron.use_lowrank_kernel: false cannot serve model.compressed (no dense fallback "
                              "for factors on Neuron); drop model.compressed or enable the kernel")
        self.model = self._factory(tnx_dir, self.args, factors, self.hf_config)

    def allocate_kv(self, num_slots: int) -> None:
        """tnx allocates the KV cache at compile time for the largest batch bucket; only check the fit."""
        if num_slots > self.args.batch_buckets[-1]:
            raise ConfigError(f"engine.max_num_seqs: {num_slots} slots exceed the compiled batch "
                              f"{self.args.batch_buckets[-1]} (neuron.batch_buckets)")

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        rows: dict[int, torch.Tensor] = {}
        decode_idx, prefill_idx = [], []
        for i, chunk in enumerate(chunks):
            if chunk.start_pos + len(chunk.token_ids) > self.max_model_len:
                raise ValueError(f"sequence in slot {chunk.slot} exceeds max_model_len {self.max_model_len}")
            if chunk.start_pos == 0 and self._pending.pop(chunk.slot, None):  # a slot whose last sequence died
                log.warning("slot %d: dropped held prompt tokens of a sequence that was not released", chunk.slot)
            (decode_idx if self._runs_on_decode_graph(chunk) else prefill_idx).append(i)
        if decode_idx:  # first: its padding rows write position 0 of the slots encoded below (module docstring)
            for i, row in zip(decode_idx, self._decode([chunks[i] for i in decode_idx])):
                if chunks[i].needs_logits:
                    rows[i] = row
        for i in prefill_idx:
            out = self._prefill(chunks[i])
            if out is not None:
                rows[i] = out
        order = [i for i, c in enumerate(chunks) if c.needs_logits]
        if not order:
            return torch.empty(0, self.vocab_size)
        return torch.stack([rows[i] for i in order])

    def _runs_on_decode_graph(self, chunk: SeqChunk) -> bool:
        """One new token: a decode, or a whole one-token prompt (tnx decodes any one-token input)."""
        if len(chunk.token_ids) != 1 or chunk.slot in self._pending:
            return False
        return chunk.start_pos > 0 or chunk.needs_logits

    def release_slot(self, slot: int) -> None:
        """The sequence in `slot` finished or was aborted: drop any prompt chunks held for it."""
        self._pending.pop(slot, None)

    def _prefill(self, chunk: SeqChunk) -> torch.Tensor | None:
        held = self._pending.pop(chunk.slot, [])
        if chunk.start_pos != len(held):
            raise ValueError(f"slot {chunk.slot}: chunk at {chunk.start_pos} after {len(held)} held prompt tokens")
        tokens = held + list(chunk.token_ids)
        if not chunk.needs_logits:  # more of the prompt is coming: the graph encodes from position 0
            self._pending[chunk.slot] = tokens
            return None
        n = len(tokens)  # >= 2: a one-token prompt runs on the decode graph (_runs_on_decode_graph)
        self.padding.record("prefill", bucket_for(n, self.args.context_buckets), n)
        logits = self._forward(torch.tensor([tokens]), torch.arange(n).unsqueeze(0), torch.tensor([chunk.slot]))
        return logits[0]

    def _decode(self, chunks: list[SeqChunk]) -> torch.Tensor:
        n = len(chunks)
        self.padding.record("decode", self.decode_batch, n)
        ids = torch.tensor([[c.token_ids[0]] for c in chunks])
        positions = torch.tensor([[c.start_pos] for c in chunks])
        return self._forward(ids, positions, torch.tensor([c.slot for c in chunks]))

    def _forward(self, input_ids: torch.Tensor, cache_ids: torch.Tensor, seq_ids: torch.Tensor) -> torch.Tensor:
        """tnx continuous-batching forward -> fp32 logits [rows, vocab] of each row's last position."""
        with torch.inference_mode():  # the slots go in start_ids (tnx v0.13.0 llama/model.py:284, base.py:492)
            logits = self.model.forward(input_ids, cache_ids=cache_ids, start_ids=seq_ids)
        logits = torch.as_tensor(logits).float()
        if logits.dim() == 3:  # [rows, tokens, vocab]: keep the last position
            logits = logits[:, -1, :]
        if logits.shape[0] != input_ids.shape[0] and logits.shape[-1] == input_ids.shape[0]:
            logits = logits.T  # vocab-major output layout
        return logits[:, : self.vocab_size]
