"""The synchronous engine: add requests, run scheduler steps through a backend, emit per-sequence deltas."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from server.backends.base import ModelRunner, SeqChunk
from server.config import SpeculativeConfig
from server.engine.block_manager import PagedKV, SlotKV
from server.engine.detokenizer import IncrementalDetokenizer
from server.engine.logits_processors import grammar_error
from server.engine.ngram import propose
from server.engine.predicted import PREDICTION_DRAFT_TOKENS, PredictedOutput
from server.engine.sampler import check_draft, sample
from server.engine.sampling_params import SamplingParams
from server.engine.scheduler import ScheduledTokens, Scheduler
from server.engine.sequence import Sequence, SeqOutput, SeqStatus, TokenLogprob
from server.engine.step_stats import LoraStats, StepStats

log = logging.getLogger(__name__)

StepObserver = Callable[[StepStats], None]


class LLMEngine:
    """Owns the scheduler and the backend; `step()` runs one batched forward."""

    def __init__(self, runner: ModelRunner, tokenizer, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, kv: PagedKV | SlotKV, eos_token_ids: set[int] | None = None, seed: int = 0,
                 max_prefill_tokens_while_decoding: int | None = None, speculative: SpeculativeConfig | None = None,
                 scheduling_policy: str = "fcfs", max_loras: int | None = None):
        self.runner = runner
        # seeds for requests that bring none: drawn from the engine's seed, so a run replays
        self._seeds = torch.Generator().manual_seed(seed)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        # a draft is checked on every position's logits: backends without them ignore predicted replies
        self.checks_drafts = getattr(runner, "supports_prompt_logprobs", False)
        if speculative is not None and not self.checks_drafts:
            raise ValueError("speculative decoding needs a backend that returns every position's logits")
        self.speculative = speculative
        self.scheduler = Scheduler(max_num_seqs, max_num_batched_tokens, kv, max_prefill_tokens_while_decoding,
                                   self._draft if self.checks_drafts else None, scheduling_policy, max_loras)
        self.eos_token_ids = frozenset(eos_token_ids or ())
        self.seqs: dict[str, list[Sequence]] = {}
        self.observers: list[StepObserver] = []
        self.max_batch_size_seen = 0

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams, n: int = 1) -> None:
        """Queue n sequences for one prompt (the caller has checked lengths)."""
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id}")
        if params.prompt_logprobs is not None and not getattr(self.runner, "supports_prompt_logprobs", False):
            raise ValueError("this backend cannot return prompt logprobs (echo with logprobs)")
        if params.embed and not getattr(self.runner, "supports_embeddings", False):
            raise ValueError("this backend cannot return embeddings")
        if params.lora is not None and params.lora not in getattr(self.runner, "loras", {}):
            raise ValueError(f"no LoRA adapter {params.lora!r} is loaded")
        adapter = self.runner.loras[params.lora].uid if params.lora is not None else None
        prefix_key = (adapter, params.cache_salt) if adapter is not None or params.cache_salt is not None else None
        seqs = []
        for index in range(n):
            generator = None
            if not params.is_greedy:
                generator = torch.Generator()
                generator.manual_seed(params.seed + index if params.seed is not None else
                                      int(torch.randint(0, 2**62, (1,), generator=self._seeds)))
            seq = Sequence(request_id, index, list(prompt_ids), params,
                           IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                                  params.include_stop_str_in_output),
                           self.eos_token_ids, generator, prefix_key=prefix_key)
            if params.prediction and self.checks_drafts:
                seq.prediction = PredictedOutput(params.prediction)
            self.scheduler.add(seq)
            seqs.append(seq)
        self.seqs[request_id] = seqs

    def load_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA folder under `name` (ValueError: the name is taken, or the folder does not fit)."""
        if not getattr(self.runner, "supports_lora", False):
            raise ValueError("this backend serves no LoRA adapters")
        if name in self.runner.loras:
            raise ValueError(f"the LoRA adapter {name!r} is already loaded")
        self.runner.add_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Forget an adapter (LookupError: no such adapter; ValueError: a request still runs through it)."""
        if name not in getattr(self.runner, "loras", {}):
            raise LookupError(f"the LoRA adapter {name!r} cannot be found")
        busy = sum(s.params.lora == name for seqs in self.seqs.values() for s in seqs if not s.is_finished)
        if busy:
            raise ValueError(f"the LoRA adapter {name!r} has {busy} sequences in flight")
        self.runner.remove_lora(name)

    def abort(self, request_id: str) -> int:
        """Drop a request wherever it is (its KV slots are free for the next step); how many of its sequences were
        still unfinished (0 for one that had ended: a client that hung up as its last token came)."""
        unfinished = [seq for seq in self.seqs.pop(request_id, []) if not seq.is_finished]
        for seq in unfinished:
            self._finish(seq, "abort")
        return len(unfinished)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[SeqOutput]:
        """Schedule, run one forward, sample (or check drafts), detokenize; outputs for sequences that advanced."""
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        self.max_batch_size_seen = max(self.max_batch_size_seen, len(chunks))
        completing = [c for c in chunks if c.completes_seq and not c.draft]  # a logits row each, in this order
        sampled = [c for c in completing if not c.seq.params.embed]
        pooled = [c for c in completing if c.seq.params.embed]  # embedding requests: a hidden row, no token
        drafted = [c for c in chunks if c.draft]
        every_row = [c.seq.wants_prompt_logits or bool(c.draft) for c in chunks]
        try:
            logits = self.runner.execute([
                SeqChunk(c.seq.slot, c.token_ids(), c.start, c.completes_seq, c.seq.block_table or None, all_rows,
                         c.seq.params.embed, c.seq.params.lora)
                for c, all_rows in zip(chunks, every_row)])
            embeddings = self._pooled_rows(chunks, every_row, pooled) if pooled else []
            # the runner may hand back inference-mode tensors, which penalties edit in place
            with torch.inference_mode():
                checked = []
                if any(every_row):
                    logits, checked = self._split_rows(chunks, every_row, logits)
                if pooled:  # their rows go to no sampler
                    logits = logits[[i for i, c in enumerate(completing) if not c.seq.params.embed]]
                tokens, logprobs = sample(logits, [c.seq for c in sampled])
                accepted = [check_draft(rows, c.draft, c.seq) for c, rows in zip(drafted, checked)]
        except Exception as exc:  # fail this step's sequences, keep the engine alive
            log.exception("forward or sampling failed for %d sequences", len(chunks))
            return [self.fail(c.seq, f"engine error: {exc.__class__.__name__}: {exc}") for c in chunks]
        num_prompt_tokens = sum(c.num_tokens for c in chunks if c.start < len(c.seq.prompt_ids))
        self.scheduler.mark_computed([c for c in chunks if not c.draft])
        now = time.monotonic()
        outputs = [self._advance(c, [tok], [lp], now) for c, tok, lp in zip(sampled, tokens, logprobs)]
        outputs += [self._embedded(c.seq, vector, now) for c, vector in zip(pooled, embeddings)]
        for chunk, new in zip(drafted, accepted):
            outputs.append(self._advance(chunk, new, [None] * len(new), now))
            if not chunk.seq.is_finished:  # the checked draft tokens' K/V stay; a rejected tail is overwritten later
                chunk.num_tokens = len(new)
                self.scheduler.mark_computed([chunk])
        if self.observers:
            stats = self._stats([c.seq for c in sampled + drafted + pooled], num_prompt_tokens, len(chunks), now)
            stats.num_generation_tokens = len(sampled) + sum(len(new) for new in accepted)
            stats.num_draft_tokens = sum(len(c.draft) for c in drafted)
            stats.num_accepted_tokens = sum(len(new) - 1 for new in accepted)
            stats.kv = replace(self.scheduler.kv.stats)
            padding = getattr(self.runner, "padding", None)  # backends with compiled buckets count their waste
            stats.padding = padding.snapshot() if padding is not None else None
            stats.lora = self._lora_stats()
            for observer in self.observers:
                observer(stats)
        return outputs

    def _lora_stats(self) -> LoraStats | None:
        sched = self.scheduler
        if sched.max_loras is None:
            return None
        names = lambda seqs: tuple(sorted({s.params.lora for s in seqs} - {None}))  # noqa: E731
        return LoraStats(names(sched.running), names(sched.waiting), sched.max_loras)

    def _draft(self, seq: Sequence) -> list[int]:
        """A decoding sequence's speculative draft, from its predicted reply where it has one and is placed in it,
        else from its own text when engine.speculative is on: for requests whose next token only the model's
        distribution under temperature, top-k and top-p decides (no penalties, processors or logprobs), within
        max_tokens and max_model_len; prompt-lookup drafts only while the running batch is no larger than
        disable_by_batch_size (a predicted reply is the client's ask)."""
        params, spec = seq.params, self.speculative
        if seq.prediction is None and spec is None:
            return []
        if params.has_penalties or params.has_logits_processors or params.logprobs is not None:
            return []
        room = min(params.max_tokens - len(seq.output_ids) - 1, self.max_model_len - seq.num_tokens)
        if room <= 0:  # the next token is the last
            return []
        if seq.prediction is not None:
            draft = seq.prediction.draft(seq.output_ids, min(room, spec.num_speculative_tokens if spec
                                                             else PREDICTION_DRAFT_TOKENS))
            if draft or spec is None:
                return draft
        if spec.disable_by_batch_size is not None and self.scheduler.num_running > spec.disable_by_batch_size:
            return []
        return propose(seq.prompt_ids + seq.output_ids, min(room, spec.num_speculative_tokens), spec.prompt_lookup_max,
                       spec.prompt_lookup_min)

    def _pooled_rows(self, chunks: list[ScheduledTokens], every_row: list[bool],
                     pooled: list[ScheduledTokens]) -> list[list[float]]:
        """Each pooled chunk's hidden state at its last position (its logits row), as fp32 values."""
        last_row, row = {}, 0
        for chunk, all_rows in zip(chunks, every_row):
            row += chunk.num_tokens if all_rows else int(chunk.completes_seq)
            last_row[id(chunk)] = row - 1
        hidden = self.runner.hidden_rows()
        return hidden[[last_row[id(c)] for c in pooled]].float().tolist()

    def _embedded(self, seq: Sequence, vector: list[float], now: float) -> SeqOutput:
        """End an embedding request's sequence with its vector (its prompt is all it had to compute)."""
        seq.first_token_time = now
        seq.embedding = vector
        self._finish(seq, "stop")
        return self._output(seq, num_new=0)

    @staticmethod
    def _split_rows(chunks: list[ScheduledTokens], every_row: list[bool],
                    logits: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """From a forward with every-position rows: record prompt logprobs; (the rows the sampler needs, each
        drafted chunk's rows in order)."""
        keep, checked, row = [], [], 0
        for chunk, all_rows in zip(chunks, every_row):
            num_rows = chunk.num_tokens if all_rows else int(chunk.completes_seq)
            if chunk.draft:
                checked.append(logits[row:row + num_rows])
            elif chunk.completes_seq:
                keep.append(row + num_rows - 1)
            if all_rows and not chunk.draft:
                _record_prompt_logprobs(chunk, logits[row:row + num_rows])
            row += num_rows
        return logits[keep], checked

    @staticmethod
    def _stats(seqs: list[Sequence], num_prompt_tokens: int, batch_size: int, now: float) -> StepStats:
        stats = StepStats(batch_size, num_prompt_tokens, len(seqs))
        for seq in seqs:
            if len(seq.output_ids) == 1:
                stats.ttfts.append(seq.first_token_time - seq.arrival_time)
                stats.queue_times.append(seq.scheduled_time - seq.arrival_time)
            elif seq.last_itl is not None:
                stats.itls.append(seq.last_itl)
            if seq.finish_reason:
                stats.finished.append((seq.finish_reason, now - seq.arrival_time))
        return stats

    def _advance(self, chunk: ScheduledTokens, tokens: list[int], logprobs: list, now: float) -> SeqOutput:
        """Append this step's tokens (one, or a checked draft's and the next), up to the first that ends the seq."""
        seq = chunk.seq
        if (error := grammar_error(seq)) is not None:  # the token sampled is the EOS its matcher forced
            return self.fail(seq, f"structured output: the grammar engine gave up on this request's grammar after "
                                  f"{len(seq.output_ids)} tokens ({error}); a simpler schema or grammar may do",
                             status=400)
        seq.first_token_time = seq.first_token_time or now
        seq.last_itl = None if seq.last_token_time is None else (now - seq.last_token_time) / len(tokens)
        seq.last_token_time = now
        count = 0
        for token, logprob in zip(tokens, logprobs):
            seq.output_ids.append(token)
            count += 1
            if logprob is not None:
                seq.pending_logprobs.append(logprob)
            reason = self._finish_reason(seq, token)
            if reason:
                self._finish(seq, reason)
                break
        if seq.prediction is not None:
            seq.prediction.follow(tokens[:count], chunk.draft)
        return self._output(seq, num_new=count)

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and token in seq.eos_token_ids:
            return "stop"
        if token in params.stop_token_ids:
            seq.stop_reason = token
            return "stop"
        if seq.detok.append(seq.output_ids):
            seq.stop_reason = seq.detok.matched
            return "stop"
        if len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence, error: str | None = None, num_new: int = 1, error_status: int = 500) -> SeqOutput:
        finished = seq.is_finished
        token_ids = seq.output_ids[-num_new:] if seq.output_ids and num_new else []
        lps = seq.pending_logprobs or None
        seq.pending_logprobs = []
        prompt_lps = seq.prompt_logprobs if seq.output_ids and seq.prompt_logprobs else None
        if prompt_lps:
            seq.prompt_logprobs = []  # sent once, with the first token
        out = SeqOutput(seq.request_id, seq.index, seq.detok.take_delta(finished), token_ids, lps,
                        seq.finish_reason if finished else None, len(seq.prompt_ids), len(seq.output_ids), error,
                        seq.num_cached_tokens, prompt_lps,
                        None if seq.prediction is None else (seq.prediction.accepted, seq.prediction.rejected),
                        seq.embedding, seq.stop_reason if finished else None, error_status)
        if finished and all(s.is_finished for s in self.seqs.get(seq.request_id, [])):
            self.seqs.pop(seq.request_id, None)
        return out

    def _finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence and tell the backend its cache slot is free (it may hold state for it)."""
        slot = seq.slot if seq.status is SeqStatus.RUNNING else -1
        self.scheduler.finish(seq, reason)
        if slot >= 0:
            self.runner.release_slot(slot)

    def fail(self, seq: Sequence, message: str, status: int = 500) -> SeqOutput:
        """End one sequence with an error its client will see (`status`: the HTTP status it means)."""
        self._finish(seq, "error")
        return self._output(seq, error=message, error_status=status)

    def fail_running(self, message: str) -> list[SeqOutput]:
        """End every request with a running sequence (a step failed outside the forward, leaving the batch
        in an unknown state) with an error; requests still queued were not touched and run next."""
        request_ids = {seq.request_id for seq in self.scheduler.running}
        outputs = [self.fail(seq, message) for rid in request_ids for seq in list(self.seqs.get(rid, []))
                   if not seq.is_finished]
        for rid in request_ids:
            self.seqs.pop(rid, None)
        return outputs


def _record_prompt_logprobs(chunk: ScheduledTokens, logits: torch.Tensor) -> None:
    """Append the logprob of each prompt token this chunk's positions predict (position p scores token p+1)."""
    seq = chunk.seq
    if chunk.start == 0:  # a new prefill (or one restarted after preemption): the first token has no context
        seq.prompt_logprobs = [None]
    targets = seq.prompt_ids[chunk.start + 1:chunk.start + chunk.num_tokens + 1]
    if not targets:
        return
    logprobs = torch.log_softmax(logits[:len(targets)].float(), dim=-1)
    target_ids = torch.tensor(targets, device=logprobs.device)
    chosen_t = logprobs.gather(1, target_ids.unsqueeze(1))
    ranks = ((logprobs > chosen_t).sum(-1) + 1).tolist()
    chosen = chosen_t.squeeze(1).tolist()
    num_top = seq.params.prompt_logprobs
    tops = [[] for _ in targets]
    if num_top:
        values, ids = torch.topk(logprobs, num_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    seq.prompt_logprobs.extend(TokenLogprob(t, lp, top, rank) for t, lp, top, rank in zip(targets, chosen, tops, ranks))
