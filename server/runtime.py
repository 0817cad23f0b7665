"""Assemble a serving runtime from a config: model folder, tokenizer, backend runner, engine."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from server.backends import create_runner
from server.config import Config, ConfigError, EngineConfig
from server.engine.block_manager import PagedKV, SlotKV
from server.engine.llm_engine import LLMEngine
from server.engine.sampling_params import SamplingParams
from server.models.gemm_tuning import bf16_kernels
from server.models.source import resolve_model_dir

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Everything the server needs: tokenizer, loaded runner, synchronous engine."""

    tokenizer: object
    runner: object
    engine: LLMEngine
    model_dir: Path | None = None


def load_tokenizer(model_dir: Path):
    """The model's tokenizer (with its chat template), offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: Path, tokenizer) -> set[int]:
    """EOS ids from generation_config.json and the tokenizer."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    return ids


def kv_pool_blocks(e: EngineConfig, bytes_per_token: int) -> int:
    """Blocks of the paged KV pool (committed at start-up): `kv_cache_gib` of them, else as many as max_num_seqs
    sequences of max_model_len."""
    if e.kv_cache_gib is None:
        return e.max_num_seqs * -(-e.max_model_len // e.block_size)
    return int(e.kv_cache_gib * 2**30 // (bytes_per_token * e.block_size))


CGROUP_ROOT = Path("/sys/fs/cgroup")


def memory_available() -> int | None:
    """Bytes this process can still commit: the kernel's MemAvailable, within the cgroup's limit where one is set
    (a container's); None where neither can be read."""
    found = []
    try:
        meminfo = Path("/proc/meminfo").read_text()
        found.append(int(next(x for x in meminfo.splitlines() if x.startswith("MemAvailable:")).split()[1]) * 1024)
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    for limit, usage in (("memory.max", "memory.current"),  # cgroup v2, then v1
                         ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            cap = (CGROUP_ROOT / limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:  # v1 writes "no limit" as a huge number
                found.append(int(cap) - int((CGROUP_ROOT / usage).read_text()))
            break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def allocate_kv(cfg: Config, runner) -> PagedKV | SlotKV:
    """The KV memory the engine schedules against: a block pool on paged backends, else a slot per sequence."""
    e = cfg.engine
    if not getattr(runner, "supports_paged_kv", False):
        runner.allocate_kv(e.max_num_seqs)
        return SlotKV(e.max_num_seqs)
    per_seq = -(-e.max_model_len // e.block_size)
    num_blocks = kv_pool_blocks(e, runner.kv_bytes_per_token())
    if num_blocks < per_seq:
        raise ConfigError(f"engine.kv_cache_gib: {num_blocks} blocks of {e.block_size} tokens cannot hold one "
                          f"sequence of max_model_len {e.max_model_len}")
    # A CPU pool is backed in the background after start-up (KVCache): one that cannot fit must fail here, not
    # under load.
    pool = num_blocks * e.block_size * runner.kv_bytes_per_token()
    available = memory_available() if getattr(runner, "device", torch.device("cpu")).type == "cpu" else None
    if available is not None and pool > available:
        raise ConfigError(f"engine.kv_cache_gib: the KV pool ({pool / 2**30:.2f} GiB: {num_blocks} blocks of "
                          f"{e.block_size} tokens) does not fit the {max(available, 0) / 2**30:.2f} GiB of memory "
                          "available; set engine.kv_cache_gib, or lower max_num_seqs or max_model_len")
    runner.allocate_kv_blocks(num_blocks, e.block_size)
    return PagedKV(num_blocks, e.block_size, e.enable_prefix_caching)


# Prompt tokens a step takes beside running decodes on a CPU (`auto`), unless its bf16 GEMMs run on AMX tiles. A
# prompt token costs ~1 ms in fp32 under AVX2, ~0.5 ms under AVX-512 and in bf16 without AMX (VDPBF16PS), so a step
# with a 512-token chunk held every stream for 0.3-0.5 s; with 128, ITL p99 fell 2.5-2.9x and TTFT p50 2-3.4x at
# c = 16 and 32 (throughput within 1.2 % in fp32 and in bf16 without AMX; TTFT p99 up to 22 % longer: the last of a
# wave of prompts waits behind the others' chunks). With AMX a bf16 step prefills 512 tokens in ~0.1 s, and a cap
# cost 1-7 % of the throughput there.
CPU_PREFILL_CAP = 128


def prefill_cap_while_decoding(e: EngineConfig, runner) -> int | None:
    """The most prompt tokens a step takes beside running decodes (None: its whole budget), with `auto` resolved
    for the runner: CPU_PREFILL_CAP on a CPU, unless the model runs in bf16 on AMX tiles; none elsewhere."""
    cap = e.max_prefill_tokens_while_decoding
    if cap == "auto":
        device, dtype = getattr(runner, "device", None), getattr(runner, "dtype", None)
        if device is None or torch.device(device).type != "cpu":
            return None
        kernels = bf16_kernels()  # tuned when the model's bf16 weights were packed
        amx_prefill = dtype == torch.bfloat16 and kernels is not None and kernels.amx_rows > 0
        return None if amx_prefill else CPU_PREFILL_CAP
    return None if cap == "off" else cap


def build_engine(cfg: Config, runner, tokenizer, eos_ids: set[int]) -> LLMEngine:
    """Allocate the KV cache and wrap the runner in an engine; logs the effective limits."""
    e = cfg.engine
    kv = allocate_kv(cfg, runner)
    cap = prefill_cap_while_decoding(e, runner)
    auto = e.max_prefill_tokens_while_decoding == "auto"
    beside = "all" if cap is None else f"{cap}, auto on a CPU without AMX prefills" if auto else str(cap)
    log.info("engine limits: max_num_seqs=%d max_num_batched_tokens=%d (prompt tokens beside decodes: %s) "
             "max_model_len=%d max_queue=%d", e.max_num_seqs, e.max_num_batched_tokens, beside, e.max_model_len,
             e.max_queue)
    log.info("KV: %s, prefix caching %s", f"{kv.stats.num_blocks} blocks of {kv.block_size} tokens"
             if kv.block_size else f"{kv.stats.num_blocks} slots", "on" if kv.enable_prefix_caching else "off")
    if e.speculative is not None:
        spec = e.speculative
        log.info("speculative decoding: n-gram drafts of up to %d tokens (lookup %d-%d) for requests without "
                 "penalties, processors or logprobs", spec.num_speculative_tokens, spec.prompt_lookup_min,
                 spec.prompt_lookup_max)
    try:
        return LLMEngine(runner, tokenizer, e.max_num_seqs, e.max_num_batched_tokens, e.max_model_len, kv, eos_ids,
                         e.seed, cap, e.speculative, e.scheduling_policy, e.max_loras if e.enable_lora else None)
    except ValueError as exc:
        raise ConfigError(f"engine.speculative: {exc}") from None


def warm_up(engine: LLMEngine, prompt_ids: list[int]) -> None:
    """Run one short greedy request through the whole engine path before serving."""
    engine.add_request("warmup", prompt_ids, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_work():
        engine.step()


def load_runtime(cfg: Config) -> Runtime:
    """Resolve, load and warm the configured model."""
    model_dir = resolve_model_dir(cfg.model, cfg.cache_path)
    tokenizer = load_tokenizer(model_dir)
    runner = create_runner(cfg, model_dir)
    runner.load()
    engine = build_engine(cfg, runner, tokenizer, eos_token_ids(model_dir, tokenizer))
    warm_up(engine, tokenizer.encode("Hello")[:8] or [0])
    return Runtime(tokenizer, runner, engine, model_dir)
