"""Distillation loss KL(teacher ‖ student) per token, and a chunked step that never holds [tokens, vocab] tensors.

The plain path (`kl_per_token` on full logits) materialises several [batch·seqlen, vocab] float32 tensors per step
(teacher logits and log-probs, student logits, log-probs and their gradients): at batch 4 × 256 and SmolLM2's
49 152-token vocabulary that is ~200 MB each, allocated and page-faulted afresh every step. `distill_backward`
instead runs both models to their final hidden states and walks the LM head in chunks of tokens, using the
closed-form gradient of KL(p ‖ softmax(z)) with respect to the student's logits z, softmax(z) − p, so each
chunk's vocabulary-sized tensors are freed before the next and autograd only ever sees the hidden state.

The leading decoder layers that the student holds frozen and identical to the teacher's (pruning keeps the first
5-6 layers of SmolLM2 whole) compute the same thing in both: `shared_prefix_layers` counts them, and the student starts
from the teacher's hidden state after them instead of running them again.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# 128 tokens × 49 152 × 4 bytes = 25 MB a tensor: under glibc's largest mmap threshold (32 MiB), so the chunks are
# reused from the heap instead of being mapped and faulted in again every step.
CHUNK_TOKENS = 128


def kl_per_token(student_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher ‖ student) in nats, summed over the vocabulary and averaged over tokens (temperature 1).

    Both [..., vocab]; teacher_logp is already log-softmaxed. Flattened to [num_tokens, vocab], kl_div's
    "batchmean" divides the total by num_tokens, so this is the mean of per-token KLs.
    """
    vocab = student_logits.shape[-1]
    student_logp = F.log_softmax(student_logits.float(), dim=-1).reshape(-1, vocab)
    return F.kl_div(student_logp, teacher_logp.reshape(-1, vocab), log_target=True, reduction="batchmean")


def teacher_log_probs(teacher: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """The frozen teacher's log-softmax [batch, seqlen, vocab] (float32, no graph; its logits are freed here)."""
    with torch.no_grad():
        return F.log_softmax(teacher(input_ids=batch).logits.float(), dim=-1)


def _plain_head(model: nn.Module) -> nn.Linear | None:
    """The model's LM head when logits are exactly head(final hidden state) with a frozen, bias-free weight."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    plain = (isinstance(head, nn.Linear) and head.bias is None and not head.weight.requires_grad
             and getattr(model.config, "final_logit_softcapping", None) is None
             and getattr(model.config, "logit_scale", None) is None)
    return head if plain else None


def can_cache_teacher(model: nn.Module, teacher: nn.Module) -> bool:
    """Whether distill_backward works from the teacher's hidden states (both LM heads plain), which a TeacherCache holds."""
    return _plain_head(model) is not None and _plain_head(teacher) is not None


def _same_and_frozen(module: nn.Module, other: nn.Module) -> bool:
    mine, theirs = module.state_dict(), other.state_dict()
    return (not any(p.requires_grad for p in module.parameters()) and mine.keys() == theirs.keys()
            and all(mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in mine))


def shared_prefix_layers(model: nn.Module, teacher: nn.Module) -> int:
    """How many leading decoder layers (and the embedding) the student runs exactly as the teacher does."""
    base, teacher_base = model.base_model, teacher.base_model
    if not _same_and_frozen(base.embed_tokens, teacher_base.embed_tokens):
        return 0
    shared = 0
    for layer, teacher_layer in zip(base.layers, teacher_base.layers):
        if not _same_and_frozen(layer, teacher_layer):
            break
        shared += 1
    return min(shared, len(base.layers) - 1)  # the student keeps at least one layer of its own to run


@contextmanager
def _layers_from(model: nn.Module, first: int):
    """The decoder runs only layers[first:] inside the block (inputs_embeds then stands for layer first's input)."""
    base = model.base_model
    layers = base.layers
    base.layers = nn.ModuleList(list(layers)[first:])
    try:
        yield
    finally:
        base.layers = layers


@dataclass
class TeacherStates:
    """The teacher's hidden states for one batch: entering the first unshared layer (None without a shared prefix),
    after the final norm (the LM head's input) and, for the hidden-state loss, after each unshared layer but the last
    (empty without it)."""

    prefix: torch.Tensor | None
    final: torch.Tensor
    layers: tuple[torch.Tensor, ...] = ()

    def tensors(self) -> list[torch.Tensor | None]:
        """prefix, final, then layers: one flat list (what the cache keeps per window)."""
        return [self.prefix, self.final, *self.layers]


def teacher_states(teacher: nn.Module, batch: torch.Tensor, shared_layers: int = 0,
                   layers: bool = False) -> TeacherStates:
    """Run the frozen teacher's decoder on batch (no graph); `layers` keeps the states after each unshared layer."""
    with torch.no_grad():
        out = teacher.base_model(input_ids=batch, output_hidden_states=shared_layers > 0 or layers, use_cache=False)
    # hidden_states: the input of every layer, then the final norm's output
    return TeacherStates(out.hidden_states[shared_layers] if shared_layers else None, out.last_hidden_state,
                         tuple(out.hidden_states[shared_layers + 1:-1]) if layers else ())


def _rms_normed(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def hidden_state_loss(student: tuple[torch.Tensor, ...], teacher: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Mean over layers and tokens of ‖rms(h_s) − rms(h_t)‖² / hidden: each token's state RMS-normalised first, as
    the next layer's norm sees it, so the few huge activation channels of the residual stream do not set the scale."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"hidden-state loss: {len(student)} student states against {len(teacher)} of the teacher")
    return sum(F.mse_loss(_rms_normed(s), _rms_normed(t)) for s, t in zip(student, teacher)) / len(student)


class TeacherCache:
    """The teacher's states per training window, for runs that see each window more than once (epochs > 1).

    The teacher is frozen, so a window's states never change: later epochs read them instead of running the teacher
    (about a third of a distillation step). Kept in float32, so a step from the cache equals one without it.
    """

    def __init__(self, layers: bool = False) -> None:
        self.layers = layers  # whether the states after each layer (the hidden-state loss's targets) are kept
        self._rows: dict[int, list[torch.Tensor | None]] = {}
        self.hits = self.misses = 0

    def states(self, teacher: nn.Module, batch: torch.Tensor, indices: torch.Tensor, shared_layers: int) -> TeacherStates:
        """batch's states (rows of windows `indices`): from the cache when every window is in it, else computed and kept."""
        keys = indices.tolist()
        if all(k in self._rows for k in keys):
            self.hits += 1
            rows = [self._rows[k] for k in keys]
            stacked = [None if row0 is None else torch.stack([r[i] for r in rows]) for i, row0 in enumerate(rows[0])]
            return TeacherStates(stacked[0], stacked[1], tuple(stacked[2:]))
        self.misses += 1
        states = teacher_states(teacher, batch, shared_layers, self.layers)
        for i, k in enumerate(keys):
            self._rows[k] = [None if t is None else t[i] for t in states.tensors()]
        return states

    @staticmethod
    def bytes_needed(num_windows: int, seqlen: int, hidden_size: int, states_per_window: int) -> int:
        """What the cache grows to over num_windows windows of float32 states."""
        return num_windows * seqlen * hidden_size * 4 * states_per_window

    @property
    def nbytes(self) -> int:
        """Bytes of the states held."""
        return sum(t.numel() * t.element_size() for row in self._rows.values() for t in row if t is not None)


def distill_backward(model: nn.Module, teacher: nn.Module, batch: torch.Tensor, shared_layers: int = 0,
                     chunk_tokens: int = CHUNK_TOKENS, states: TeacherStates | None = None,
                     hidden_weight: float = 0.0, ce_weight: float = 0.0) -> float:
    """Accumulate d [KL(teacher ‖ student) + hidden_weight · hidden_state_loss + ce_weight · next-token CE]/d params
    into .grad for one batch; returns the mean per-token KL (the other two terms are left out of it). The CE is the
    usual causal-LM loss on batch itself (HF's `labels=batch`: mean over every position but each window's last).

    Equal to `kl_per_token(model(batch).logits, teacher_log_probs(teacher, batch)).backward()` (tests check both
    the value and the gradients); models whose logits are not a plain frozen linear head take that path.
    `shared_layers` (from `shared_prefix_layers`) leading layers are taken from the teacher's pass; `states`, the
    teacher's states for batch when known (TeacherCache), stand in for running it.
    """
    head, teacher_head = _plain_head(model), _plain_head(teacher)
    if head is None or teacher_head is None:
        if hidden_weight:
            raise ValueError("the hidden-state loss needs plain LM heads (the chunked distillation step)")
        out = model(input_ids=batch, labels=batch if ce_weight else None)
        loss = kl_per_token(out.logits, teacher_log_probs(teacher, batch))
        (loss + ce_weight * out.loss if ce_weight else loss).backward()
        return loss.item()
    layers = hidden_weight > 0
    if states is None:
        states = teacher_states(teacher, batch, shared_layers, layers)
    teacher_hidden = states.final
    if shared_layers:
        with _layers_from(model, shared_layers):
            out = model.base_model(inputs_embeds=states.prefix, output_hidden_states=layers, use_cache=False)
    else:
        out = model.base_model(input_ids=batch, output_hidden_states=layers, use_cache=False)
    hidden = out.last_hidden_state
    flat, teacher_flat = hidden.detach().reshape(-1, hidden.shape[-1]), teacher_hidden.reshape(-1, hidden.shape[-1])
    num_tokens = flat.shape[0]
    weight, teacher_weight = head.weight, teacher_head.weight
    # next token of each position, -1 at each window's last (no label), flattened as the hidden states are
    labels = torch.cat([batch[:, 1:], batch.new_full((batch.shape[0], 1), -1)], dim=1).reshape(-1)
    num_labels = batch.shape[0] * (batch.shape[1] - 1)
    grad = torch.empty_like(flat)
    total = 0.0
    with torch.no_grad():
        for lo in range(0, num_tokens, chunk_tokens):
            rows = slice(lo, lo + chunk_tokens)
            teacher_logp = F.log_softmax((teacher_flat[rows] @ teacher_weight.T).float(), dim=-1)
            student_logp = F.log_softmax((flat[rows] @ weight.T).float(), dim=-1)
            teacher_p = teacher_logp.exp()
            total += (teacher_p * (teacher_logp - student_logp)).sum().item()
            student_p = student_logp.exp_()
            ce = None
            if ce_weight and num_labels:  # d CE/dz = softmax(z) − onehot(label), mean over labelled positions
                chunk_labels = labels[rows]
                labelled = (chunk_labels >= 0).nonzero().flatten()
                ce = student_p[labelled]  # a copy, taken before student_p becomes the KL's gradient in place
                ce[torch.arange(len(labelled)), chunk_labels[labelled]] -= 1.0
            # d/dz Σ p (log p − log softmax z) = softmax(z) − p, per token; the mean over tokens divides by N.
            dlogits = student_p.sub_(teacher_p).div_(num_tokens)
            if ce is not None:
                dlogits.index_add_(0, labelled, ce, alpha=ce_weight / num_labels)
            grad[rows] = (dlogits.to(weight.dtype) @ weight).to(grad.dtype)
    if layers and states.layers:  # (a student that runs only its last layer has no state to compare)
        extra = hidden_weight * hidden_state_loss(tuple(out.hidden_states[1:-1]), states.layers)
        torch.autograd.backward([hidden, extra], [grad.view_as(hidden), None])
    else:
        hidden.backward(grad.view_as(hidden))
    return total / num_tokens
