"""The training objective: the summed next-token cross-entropy of a batch's real targets.

A target equal to IGNORE_INDEX (padding, the first token of another document in a packed window,
the padding of a perplexity window) adds nothing to the loss and is not counted. The trainer
divides the sum by the real targets of the whole global batch (see trainer.py).

Training and validation never hold the logits whole: `linear_token_loss_sum` computes the lm_head
and the cross-entropy a chunk of tokens at a time (the model calls it when given ``labels``), so
the (tokens x vocab) fp32 tensor, the largest of a small model's step, exists a chunk at a time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from llama_ddp.attention_plan.plan import IGNORE_INDEX, own

if TYPE_CHECKING:
    from llama_ddp.precision import Precision


class Scored(Protocol):
    """What the loss reads of a batch (batch.Batch; a target is attention_plan/plan.py's
    IGNORE_INDEX where there is none): the inputs, their attention plan, and the targets of the
    rows the model outputs."""

    x: torch.Tensor
    plan: Any
    labels: torch.Tensor
    rows: torch.Tensor | None  # the output rows scored (evaluation); None: every row


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``logits`` (..., V), in fp32, against ``labels`` (one per logits
    row, IGNORE_INDEX where there is no target)."""
    logits = logits.flatten(0, -2)  # (N, V): one row per label
    return F.cross_entropy(
        logits.float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


# Each chunk adds its (vocab x hidden) weight gradient into the fp32 sum: on a GPU a chunk of at
# least this many tokens (where the batch has them) keeps that traffic a small share of the
# chunk's products, and proportional to the tokens, whatever the vocabulary (issue 53).
WEIGHT_GRAD_ROWS = 4096
# On the CPU a chunk's fp32 logits take about this many bytes: within the last-level cache (32 MiB
# on a 2-core EPYC slice), so that the softmax's passes and the two backward products read them
# from cache rather than memory (issue 59). The weight gradient's traffic per chunk (8 bytes a
# weight in fp32, 12 in bf16) against the chunk's 6 x rows FLOPs a weight stays a small share
# of a CPU's time from 64 rows up, whatever the shape.
CPU_LOGITS_BYTES = 8 * 2**20


def chunk_tokens(tokens: int, hidden: int, vocab: int, device: str) -> int:
    """Tokens per chunk of `linear_token_loss_sum` on a ``device`` of this type ("cpu",
    "cuda", ...). The CPU: as many rows as `CPU_LOGITS_BYTES` of fp32 logits hold (a multiple of
    64, at least 64: 256 at a vocabulary of 8192, 64 from 32768 up). Other devices:
    ceil(vocab / hidden) chunks (Liger-Kernel's rule: a chunk's logits about the size of the
    hidden states), but no chunk under `WEIGHT_GRAD_ROWS` tokens where the batch has more: each
    chunk reads and writes the whole fp32 weight gradient (12 bytes a weight in bf16: its
    product, then the sum), so with Liger's rule alone a 128k vocabulary's ~170 chunks would move
    ~12 x vocab^2 bytes a micro-step whatever its tokens; with the floor, at most 12 x vocab x
    hidden bytes per 4096 tokens. At most the tokens, rounded up to a multiple of 64 rows (whole
    matmul tiles)."""
    if device == "cpu":
        per_chunk = min(tokens, max(64, CPU_LOGITS_BYTES // (4 * vocab) // 64 * 64))
    else:
        per_chunk = max(-(-tokens // -(-vocab // hidden)), min(tokens, WEIGHT_GRAD_ROWS))
    return max(64, -(-per_chunk // 64) * 64)


def check_labels(labels: torch.Tensor, vocab: int) -> None:
    """An error, as torch's cross_entropy gives, for a label outside [0, ``vocab``) that is not
    IGNORE_INDEX (nanoGPT's -1 is not ours): an IndexError for labels on the CPU, a device-side
    assertion on an accelerator. Never a host read of the labels where they are right (the
    training path: `torch._assert_async` is one op, no sync)."""
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
    what = f"labels are token ids in [0, {vocab}) or {IGNORE_INDEX} (ignored)"
    try:
        torch._assert_async(~bad.any(), f"a target is out of bounds: {what}")
    except RuntimeError:  # the CPU checks at once: name the first such target, as torch does
        raise IndexError(f"Target {int(labels[bad][0])} is out of bounds: {what}") from None


def linear_token_loss_sum(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk: int | None = None,
    *,
    backend: str | Callable | None = None,
) -> torch.Tensor:
    """`token_loss_sum` of the logits ``hidden @ weight.T`` ((..., C) hidden states, (V, C)
    lm_head weight), never holding them whole: ``chunk`` tokens at a time (None:
    `chunk_tokens`). The matmuls run in autocast's dtype where it is on (as the lm_head's would),
    the softmax in fp32. The gradients are computed in the forward, chunk by chunk, and scaled in
    the backward: three matmuls as the whole lm_head's forward and backward, no recomputation;
    under ``torch.no_grad`` (evaluation) none are: one matmul, as the lm_head's forward alone.
    ``backend``: each chunk's softmax, loss and gradient through torch.compile with this backend
    (`chunk_loss`: one fused kernel over the chunk's logits instead of eager's five passes;
    where the run compiles, parallelize.compile_layers); None: eager."""
    hidden = hidden.flatten(0, -2)  # (N, C): one row per label
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
    dtype = dtype or torch.promote_types(hidden.dtype, weight.dtype)
    check_labels(labels, weight.shape[0])
    chunk = chunk or chunk_tokens(*hidden.shape, weight.shape[0], device)
    grads = torch.is_grad_enabled()  # a Function's forward sees no grad mode, only its inputs'
    terms = chunk_loss if backend is None else compiled_chunk_loss(backend)
    args = hidden.to(dtype), weight.to(dtype), own(labels.flatten()), chunk, grads, terms
    return _LinearCrossEntropy.apply(*args)


def chunk_loss(
    h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, grads: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk of `linear_token_loss_sum`: the summed fp32 cross-entropy of the logits
    ``h @ weight.T`` ((n, V), the only logits there are) against ``labels`` and, with
    ``grads``, d(loss)/d(logits) = softmax - one_hot(target) in ``h``'s dtype. An ignored
    target's row holds its softmax: the caller drops it where it is cheaper, in the (n, C) hidden
    states and their gradient rather than the (n, V) logits. Eager: the logits' fp32 buffer
    read for the max, exponentiated in place once (eager logsumexp would make and exponentiate
    a copy of its own, the gradient a second time), summed, and scaled into the gradient, from
    which the loss takes the log of the sum: five passes, no other (n, V) fp32 tensor.
    Compiled: one fused kernel reads the logits and writes the gradient."""
    logits = (h @ weight.T).float()
    real = (labels != IGNORE_INDEX).unsqueeze(1)  # (n, 1)
    target = labels.clamp(min=0).unsqueeze(1)  # an ignored row's is any class: dropped
    picked = logits.gather(1, target)  # (n, 1), before the buffer is overwritten
    top = logits.amax(-1, keepdim=True)
    e = logits.sub_(top).exp_()  # exp(logits - max), as logsumexp computes it
    sums = e.sum(-1, keepdim=True)
    total = torch.where(real, top + sums.log() - picked, 0.0).sum()
    if not grads:
        return total, None
    if h.dtype == torch.float32:
        g = e.div_(sums)
    else:  # scaled and rounded in one pass
        g = torch.div(e, sums, out=torch.empty(e.shape, dtype=h.dtype, device=e.device))
    return total, g.scatter_add_(1, target, real.to(g.dtype).neg())


@functools.cache
def compiled_chunk_loss(backend: str | Callable = "inductor") -> Callable:
    """`chunk_loss` through torch.compile, once per process and backend: its sizes symbolic
    (the last chunk is shorter, pad-mode batches vary), a graph for each of grads on/off and
    dtype."""
    return torch.compile(chunk_loss, backend=backend, dynamic=True, fullgraph=True)


def add_product(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``total += a @ b``: fp32 ``total``, low-precision ``a`` and ``b``. Where the device's
    matmul writes fp32 from bf16/fp16 inputs (CUDA's ``out_dtype``), the product is accumulated
    into ``total`` in the matmul itself (8 bytes an element moved); else the low-precision
    product is made, then added (12)."""
    if _accumulates_in_fp32(a.device, a.dtype):
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    else:
        total += a @ b


@functools.cache
def _accumulates_in_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(..., out_dtype=float32, out=fp32)`` runs for ``dtype`` inputs on
    ``device`` and equals the product made then added (tried once on small matrices)."""
    if device.type != "cuda":
        return False
    try:
        g = torch.Generator(device=device).manual_seed(0)
        a, b = (torch.randn(64, 64, device=device, generator=g).to(dtype) for _ in range(2))
        total = torch.ones(64, 64, device=device)
        torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
        made = 1 + (a.float() @ b.float())
        return bool((total - made).abs().max() <= 1e-2 * made.abs().max())
    except Exception:  # this torch or device has none (its error's type varies by release)
        return False


class _LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T`` against ``labels``, a chunk at a time
    (``terms``: `chunk_loss`, eager or compiled); the gradients (fp32 until scaled) are made in
    the forward where the inputs need them."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, grads, terms):
        want_h, want_w = (grads and wanted for wanted in ctx.needs_input_grad[:2])
        f32 = {"dtype": torch.float32, "device": hidden.device}
        grad_h = torch.empty(hidden.shape, **f32) if want_h else None
        grad_w = torch.zeros(weight.shape, **f32) if want_w else None
        total = torch.zeros((), **f32)
        with torch.autocast(hidden.device.type, enabled=False):
            for start in range(0, hidden.shape[0], chunk):
                rows = slice(start, start + chunk)
                h, y = hidden[rows], labels[rows]
                g = None  # the last chunk's gradient freed before this chunk's logits are made
                loss, g = terms(h, weight, y, want_h or want_w)
                total += loss
                if g is None:
                    continue
                ignored = (y == IGNORE_INDEX).unsqueeze(1)  # their rows of g: a softmax
                if want_h:
                    if h.dtype == torch.float32:  # into the fp32 gradient: no temporary copy
                        torch.mm(g, weight, out=grad_h[rows])
                    else:
                        grad_h[rows] = g @ weight
                    grad_h[rows].masked_fill_(ignored, 0.0)
                if want_w:
                    h = h.masked_fill(ignored, 0.0)
                    if h.dtype == torch.float32:
                        grad_w.addmm_(g.T, h)
                    else:
                        add_product(grad_w, g.T, h)
        ctx.dtypes = hidden.dtype, weight.dtype
        ctx.save_for_backward(grad_h, grad_w)
        return total

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        h_dtype, w_dtype = ctx.dtypes
        dh = None if grad_h is None else (grad_h * grad).to(h_dtype)
        dw = None if grad_w is None else (grad_w * grad).to(w_dtype)
        return dh, dw, None, None, None, None


def batch_loss_sum(model: nn.Module, batch: Scored, precision: Precision) -> torch.Tensor:
    """Summed next-token loss of a batch's real targets, the forward under the run's autocast.
    The batch's attention plan, already on the model's device, tells the model which positions
    it computes (pad mode: the real ones) and the spans they attend within (documents); its
    ``rows``, where given, the positions that are scored (those with a target). The model
    computes the loss from its labels (`linear_token_loss_sum`), inside whatever wrapper it
    runs in (DDP, FSDP, DataParallel), never the logits whole."""
    scored = {} if batch.rows is None else {"rows": batch.rows}  # training: the wrapper's call
    with precision.autocast():
        return model(batch.x, plan=batch.plan, labels=batch.labels, **scored)
