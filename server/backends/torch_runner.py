"""PyTorch backend (CPU, or CUDA when present): the compact Llama over a slot KV cache."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from server.backends.base import SeqChunk
from server.backends.decode_graphs import BATCH_SIZES, DecodeGraphs
from server.errors import ConfigError
from server.models.cpu_features import activation_dtype, resolve_dtype
from server.models.fused_ops import kernels_for
from server.models.gguf_blocks import GgufBlocks
from server.models.hugepages import return_freed_heap
from server.models.int8_linear import int8_available
from server.models.llama import FlatBatch, KVCache, LlamaModel, PrefillChunk
from server.models.loader import load_llama
from server.models.lora import LoraAdapter, load_lora_adapter, lora_rows
from server.models.packed_linear import FactoredPanelLinear, pack_linears, packing_available, panels_available

log = logging.getLogger(__name__)

_NARROW_CACHES = (torch.float16, torch.bfloat16)
_FP8_NAMES = ("fp8", "fp8_e4m3")  # vLLM's spellings of an e4m3 cache
_FP8_MODELS = (torch.float32, torch.bfloat16)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's dtype for `engine.kv_cache_dtype`: auto is the model's; fp16 / bf16 also under an fp32 model;
    fp8 (e4m3fn) under an fp32 or bf16 model."""
    if name == "auto":
        return model_dtype
    chosen = torch.float8_e4m3fn if name in _FP8_NAMES else getattr(torch, name)
    allowed = (chosen == model_dtype or (model_dtype == torch.float32 and chosen in _NARROW_CACHES)
               or (chosen == torch.float8_e4m3fn and model_dtype in _FP8_MODELS))
    if not allowed:
        model = str(model_dtype).removeprefix("torch.")
        raise ConfigError(f"engine.kv_cache_dtype: {name} under a {model} model is not supported "
                          f"(auto, {model}, float16 / bfloat16 under float32, or fp8 under float32 / bfloat16)")
    return chosen


def check_quantization(name: str | None, device: torch.device, gguf_source: Path | None = None) -> str | None:
    """`model.quantization` where this backend can take it: int8 weights or a GGUF's blocks on a CPU (the latter from
    `gguf_source`), or None (unset, or `none`; TorchRunner decides what unset runs)."""
    if name is None or name == "none":
        return None
    if name not in ("int8", "gguf"):
        raise ConfigError(f"model.quantization: {name!r} is not supported (int8, gguf, none, or unset)")
    if device.type != "cpu":
        raise ConfigError(f"model.quantization: {name} weights run on the CPU panel GEMMs, not on {device.type}")
    if name == "gguf" and gguf_source is None:
        raise ConfigError("model.quantization: gguf runs a GGUF's own blocks: it needs model.source gguf")
    return name


def resolve_weight_dtype(dtype: str, device: torch.device, quantization: str | None,
                         log_choice: bool = True) -> torch.dtype:
    """The model's weight dtype for `model.dtype`: resolve_dtype's, but fp32 under `quantization: gguf` (the dtype
    its blocks decode to; auto picks it, and nothing else is allowed)."""
    if quantization != "gguf":
        return resolve_dtype(dtype, device, log_choice=log_choice)
    if dtype not in ("auto", "float32"):
        raise ConfigError(f"model.dtype: {dtype} under quantization gguf (its blocks decode to fp32: auto or float32)")
    if log_choice:
        log.info("dtype float32: the GGUF's blocks decode to fp32 weights")
    return torch.float32


class TorchRunner:
    """Runs flat mixed prefill/decode batches through `LlamaModel` on one device.

    Paged: the engine sizes a pool of blocks (allocate_kv_blocks) and sends each chunk's block table.
    A slot cache (allocate_kv, for tests and benches) is the case of one max_model_len block per slot.
    """

    supports_paged_kv = True
    supports_prompt_logprobs = True  # SeqChunk.all_logits
    supports_embeddings = True  # hidden_rows
    supports_lora = True  # SeqChunk.lora names one of lora_modules

    def __init__(self, model_dir: Path, max_model_len: int, dtype: str = "auto", device: str = "cpu",
                 compressed: Path | None = None, num_threads: int | None = None, pack_weights: bool = True,
                 fused_kernels: bool = True, panel_gemm: bool = True, kv_cache_dtype: str = "auto",
                 cuda_graphs: bool = True, max_num_seqs: int | None = None,
                 lora_modules: dict[str, Path] | None = None, max_lora_rank: int = 16, quantization: str | None = None,
                 gguf_source: Path | None = None):
        self.model_dir = model_dir
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.quantization = check_quantization(quantization, self.device, gguf_source)  # None, "int8" or "gguf"
        self.gguf_source = gguf_source  # the GGUF whose blocks `quantization: gguf` runs
        self.weight_dtype = resolve_weight_dtype(dtype, self.device, self.quantization)
        # Unset: fp32 weights on a CPU from a GGUF are held as its blocks where it has them (the same sums, bit for
        # bit, from a third of the bytes); `none` keeps fp32 panels.
        self.blocks_by_default = (quantization is None and gguf_source is not None and self.device.type == "cpu"
                                  and self.weight_dtype == torch.float32)
        if self.blocks_by_default:
            self.quantization = "gguf"
        self.dtype = activation_dtype(self.weight_dtype, self.device)  # the model's compute dtype
        self.cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, self.dtype)
        self.compressed = compressed
        self.num_threads = num_threads
        self.pack_weights = pack_weights
        self.fused_kernels = fused_kernels
        self.panel_gemm = panel_gemm  # panels for our GEMM where the CPU builds it (bf16: AVX512-BF16, fp32: AVX512F)
        self.cuda_graphs = cuda_graphs  # decode steps replayed from CUDA graphs on a CUDA device (off: eager)
        self.max_num_seqs = max_num_seqs  # the engine's largest batch: its graphs are captured at start-up
        self.graphs: DecodeGraphs | None = None
        self.lora_modules = dict(lora_modules or {})  # adapter name -> PEFT folder, read at load()
        self.max_lora_rank = max_lora_rank
        self.loras: dict[str, LoraAdapter] = {}
        self.model: LlamaModel | None = None
        self.cache: KVCache | None = None
        self.vocab_size = 0

    @property
    def precision(self) -> str:
        """The model's dtype for reports: its compute dtype, and its weights' where they differ."""
        name = str(self.dtype).removeprefix("torch.")
        if self.quantization:
            return f"{name}, {self.quantization} weights"
        return name if self.weight_dtype == self.dtype else f"{name}, {str(self.weight_dtype).removeprefix('torch.')} weights"

    def load(self) -> None:
        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        self.model = load_llama(self.model_dir, self.max_model_len, self.dtype, self.compressed).to(self.device)
        if self.weight_dtype != self.dtype:  # bf16 weights under fp32 activations: the model's values are bf16's
            with torch.no_grad():
                for p in self.model.parameters():
                    p.copy_(p.to(self.weight_dtype))
        self.vocab_size = self.model.config.vocab_size
        use_panels = self.panel_gemm and panels_available(self.device, self.dtype)
        if self.quantization == "int8" and not (self.pack_weights and use_panels and int8_available()):
            raise ConfigError("model.quantization: int8 weights need the CPU panel GEMMs (AVX512-VNNI, or AVX2), "
                              "which this CPU or build lacks")
        blocks = self._gguf_blocks(use_panels) if self.quantization == "gguf" else None
        if self.pack_weights and packing_available(self.device, self.dtype):
            pack_linears(self.model, use_panels=use_panels, panel_dtype=self.weight_dtype,
                         int8=self.quantization == "int8", blocks=blocks)
        if self.fused_kernels:
            self.model.use_kernels(kernels_for(self.device, self.dtype))
        for name, path in self.lora_modules.items():
            self.add_lora(name, path)
        if self.device.type == "cpu":
            return_freed_heap()

    def _gguf_blocks(self, use_panels: bool) -> GgufBlocks | None:
        """The GGUF's quantised rows for `quantization: gguf`; where they were not asked for and cannot run (no panel
        GEMMs, or a GGUF without Q4_1 / Q8_0 tensors) None, and the weights stay fp32 panels."""
        if not (self.pack_weights and use_panels):
            why = "need the CPU panel GEMMs (AVX-512 or AVX2), which this CPU or build lacks"
        else:
            try:
                blocks = GgufBlocks.read(self.gguf_source)
            except ValueError as exc:
                raise ConfigError(f"model.quantization: {exc}") from None
            if not blocks.empty:
                return blocks
            why = f"are not in {self.gguf_source.name} (it holds no Q4_1 or Q8_0 tensors)"
        if not self.blocks_by_default:
            raise ConfigError(f"model.quantization: a GGUF's blocks {why}")
        self.quantization = None
        return None

    def add_lora(self, name: str, path: str | Path) -> None:
        """Load one more adapter (ConfigError: the folder does not fit the model)."""
        self.loras[name] = self._ready(load_lora_adapter(name, Path(path), self.model.config, self.dtype,
                                                         self.max_lora_rank))

    def remove_lora(self, name: str) -> None:
        """Forget an adapter (the engine has checked that no sequence runs through it)."""
        del self.loras[name]

    def _ready(self, adapter: LoraAdapter) -> LoraAdapter:
        """The adapter on the device, its updates on the panel GEMM where the model's projections run on it."""
        adapter = adapter.to(self.device)
        if not (self.pack_weights and self.panel_gemm and panels_available(self.device, self.dtype)
                and hasattr(torch.ops.neuronmm, "factored_linear")):
            return adapter

        def pack(A: torch.Tensor, B: torch.Tensor) -> FactoredPanelLinear | None:
            if self.weight_dtype == torch.bfloat16 and (A.shape[0] % 2 or A.shape[1] % 2):
                return None  # (bf16 panels pair the inner dimension)
            return FactoredPanelLinear(A, [A.shape[0]], [B], self.weight_dtype)

        adapter = adapter.with_packed_updates(pack)
        if any(d.packed is None for d in adapter.deltas.values()) or not hasattr(torch.classes.neuronmm, "LoraPlan"):
            return adapter  # (an update the panel GEMM cannot take: the Python layer loop runs its steps)
        plan = torch.classes.neuronmm.LoraPlan()
        no_second = torch.empty(0)
        for layer in range(self.model.config.num_hidden_layers):
            for slot in range(4):
                delta = adapter.deltas.get((layer, slot))
                if delta is None:
                    plan.add_none()
                else:
                    first, splits, seconds, outs = delta.packed.factored_args()
                    plan.add_update(first, splits, [no_second if b is None else b for b in seconds], outs)
        return adapter.with_plan(plan)

    def allocate_kv(self, num_slots: int) -> None:
        self.allocate_kv_blocks(num_slots, self.max_model_len)

    def allocate_kv_blocks(self, num_blocks: int, block_size: int) -> None:
        cfg = self.model.config
        start = time.perf_counter()
        graphs = self.cuda_graphs and self.device.type == "cuda"  # one block more: the padding rows' scratch block
        self.cache = KVCache(cfg.num_hidden_layers, num_blocks + graphs, cfg.num_key_value_heads, block_size,
                             cfg.head_dim, self.cache_dtype, self.device)
        self.graphs = (DecodeGraphs(self.model, self.cache, scratch_block=num_blocks, max_batch=BATCH_SIZES[-1],
                                    max_blocks=-(-self.max_model_len // block_size)) if graphs else None)
        if self.graphs is not None and self.max_num_seqs:
            self.graphs.capture_up_to(self.max_num_seqs)
        log.info("KV cache: %d blocks x %d tokens in %s, %.0f MiB allocated in %.2f s%s",
                 num_blocks, block_size, str(self.cache_dtype).removeprefix("torch."), self.cache.nbytes() / 2**20,
                 time.perf_counter() - start,
                 " (its first blocks backed, the rest in the background)" if self.cache.committing else "")

    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * self.cache_dtype.itemsize

    def build_batch(self, chunks: list[SeqChunk]) -> FlatBatch:
        """Flatten chunks into the model's FlatBatch (one host->device copy per field)."""
        ids, positions, slot_mapping, seq_index, context_lens, logits_index = [], [], [], [], [], []
        with_lora = any(chunk.lora for chunk in chunks)
        adapters: list[str | None] = []  # each token's LoRA adapter (None: the base model), in a step that has any
        sdpa_chunks, tables = [], []
        block_size = self.cache.block_size
        sdpa_min_chunk = self.model.kernels.sdpa_min_chunk
        for row, chunk in enumerate(chunks):
            n, start = len(chunk.token_ids), chunk.start_pos
            if start + n > self.max_model_len:
                raise ValueError(f"sequence in slot {chunk.slot} exceeds max_model_len {self.max_model_len}")
            table = chunk.block_table if chunk.block_table is not None else [chunk.slot]
            if len(table) * block_size < start + n:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {start + n} positions")
            tables.append(table)
            fused = sdpa_min_chunk is None or n < sdpa_min_chunk
            if not fused:
                sdpa_chunks.append(PrefillChunk(len(ids), n, row, start))
            ids.extend(chunk.token_ids)
            positions.extend(range(start, start + n))
            slot_mapping.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + n))
            seq_index.extend([row] * n)
            if with_lora:
                adapters.extend([chunk.lora] * n)
            context_lens.extend(range(start + 1, start + n + 1) if fused else [0] * n)
            if chunk.all_logits:
                logits_index.extend(range(len(ids) - n, len(ids)))
            elif chunk.needs_logits:
                logits_index.append(len(ids) - 1)
        as_tensor = lambda xs, dtype=torch.long: torch.tensor(xs, dtype=dtype, device=self.device)  # noqa: E731
        width = max(len(t) for t in tables)
        # a decode step's tokens all want logits: None spares the LM head's input a gather (~30-100 µs: at the end of
        # a step, whose weights streamed through the caches, an op runs cold)
        every_token = logits_index == list(range(len(ids)))
        return FlatBatch(
            input_ids=as_tensor(ids), positions=as_tensor(positions), slot_mapping=as_tensor(slot_mapping),
            seq_index=as_tensor(seq_index, torch.int32), context_lens=as_tensor(context_lens, torch.int32),
            block_tables=as_tensor([t + [0] * (width - len(t)) for t in tables], torch.int32),
            logits_index=None if every_token else as_tensor(logits_index), sdpa_chunks=sdpa_chunks,
            lora=(lora_rows(self.loras, adapters, None if every_token else logits_index, self.device)
                  if with_lora else []))

    def execute(self, chunks: list[SeqChunk]) -> torch.Tensor:
        batch = self.build_batch(chunks)
        if (self.graphs is not None and self.graphs.applies(batch) and not batch.lora
                and not any(c.wants_hidden for c in chunks)):
            return self.graphs.run(batch)  # (a replayed graph keeps no hidden states, adds no adapter)
        return self.model(batch, self.cache)

    def hidden_rows(self) -> torch.Tensor:
        return self.model.last_hidden

    def release_slot(self, slot: int) -> None:
        """Cache positions are overwritten before they are read; nothing to clear."""
