"""Causal attention within segments of a flat token stream: one operator per layer.

``attend(q, k, v, plan)`` runs ``llama_ddp::segment_attention``, a ``torch.library.custom_op``
with a fake kernel and an autograd formula (its backward is a custom op too), so torch.compile
captures a whole decoder layer around it as one graph, activation checkpointing included, while
the segments change with every batch. Its kernels, chosen by device and dtype:
- ``varlen``: CUDA in fp16/bf16 on a GPU with flash attention (compute capability 8+): one call
  of torch's flash varlen kernel (``torch.nn.attention.varlen``), causal, grouped-query
  attention native, on the segments as ``cu_seqlens``;
- ``grids``: CPU: the plan's bucketed grids, one causal call of the CPU flash kernel per grid
  (the kernel ``F.scaled_dot_product_attention`` picks there), its log-sum-exp kept for the
  backward;
- ``sdpa``: elsewhere (CUDA in fp32, GPUs without flash): the grids through
  ``F.scaled_dot_product_attention``; the backward recomputes each grid's probabilities (a
  (rows, H, width, width) tensor at a time: correct everywhere, not the fast path).
Every kernel reads the plan's host tensor ``grids`` on the host or not at all: none waits for
the device.

Shapes: N tokens, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llama_ddp.layout import AttentionPlan

Tensor = torch.Tensor
HALF = (torch.float16, torch.bfloat16)
_CAUSAL = [-1, 0]  # flash's window (left, right): causal


def kernel_for(q: Tensor, plan: AttentionPlan) -> str:
    if plan.flash and q.dtype in HALF and q.shape[-1] % 8 == 0 and q.shape[-1] <= 256:
        return "varlen"
    return "grids" if q.device.type == "cpu" else "sdpa"


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> Tensor:
    """Causal attention of (N, H, D) queries over (N, K, D) keys/values within the plan's
    segments -> (N, H, D)."""
    out, _ = segment_attention(
        q,
        k,
        v,
        plan.cu_seqlens,
        plan.max_seqlen,
        plan.grids,
        plan.slots,
        plan.padding,
        kernel_for(q, plan),
    )
    return out


@torch.library.custom_op("llama_ddp::segment_attention", mutates_args=())
def segment_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    grids: Tensor,
    slots: Tensor,
    padding: Tensor,
    kernel: str,
) -> tuple[Tensor, Tensor]:
    """(out (N, H, D), log-sum-exp of each query's scores: (H, N) float32 for ``varlen``,
    (N, H) for the grids, which ``sdpa`` leaves empty)."""
    if kernel == "varlen":
        out, lse, _ = torch.ops.torch_attn._varlen_attn(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, None, _CAUSAL, True
        )
        return out, lse
    grid = Grids(q, grids, slots, padding)
    outs, lses = [], []
    for i, (qg, kg, vg) in enumerate(zip(*(grid.place(x) for x in (q, k, v)))):
        if kernel == "grids":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qg, kg, vg, 0.0, True
            )
            lses.append(grid.take(i, lse.transpose(1, 2)))  # (rows, width, H) -> (n, H)
        else:
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        outs.append(grid.take(i, out.transpose(1, 2)))
    lse = _cat(lses) if lses else q.new_empty(0, dtype=torch.float32)
    return _cat(outs), lse


@segment_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, grids, slots, padding, kernel):
    n, h, _ = q.shape
    shape = {"varlen": (h, n), "grids": (n, h)}.get(kernel, (0,))
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty(
        shape, dtype=torch.float32
    )


@torch.library.custom_op("llama_ddp::segment_attention_backward", mutates_args=())
def segment_attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    grids: Tensor,
    slots: Tensor,
    padding: Tensor,
    kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `segment_attention` for the output gradient ``grad``."""
    if kernel == "varlen":
        rng = torch.zeros(2, dtype=torch.uint64, device=q.device)  # no dropout: unused
        return torch.ops.torch_attn._varlen_attn_backward(
            grad, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, True, rng,
            None, _CAUSAL,
        )  # fmt: skip
    grid = Grids(q, grids, slots, padding)
    placed = [grid.place(x) for x in (grad, q, k, v)]
    if kernel == "grids":
        placed += [grid.place(out), grid.place(lse.unsqueeze(-1))]
    dq, dk, dv = [], [], []
    for i, tensors in enumerate(zip(*placed)):
        if kernel == "grids":
            g, qg, kg, vg, og, lse_g = tensors
            lse_g = lse_g.squeeze(-1).contiguous()  # (rows, H, width)
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, qg, kg, vg, og, lse_g, 0.0, True
            )
        else:
            grads = _causal_attention_backward(*tensors)
        for acc, d in zip((dq, dk, dv), grads):
            acc.append(grid.take(i, d.transpose(1, 2)))
    return tuple(_cat(d) for d in (dq, dk, dv))


@segment_attention_backward.register_fake
def _(grad, q, k, v, out, lse, cu_seqlens, max_seqlen, grids, slots, padding, kernel):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


# The sdpa kernel's backward holds (rows, H, W, W) fp32 probabilities for this many bytes at most.
_PROBABILITY_BYTES = 2**28


def _causal_attention_backward(g: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, ...]:
    """(dq, dk, dv) of causal attention of (rows, H, W, D) q over (rows, K, W, D) k, v for the
    output gradient g, from the probabilities recomputed in fp32, a few rows at a time (the
    ``sdpa`` kernel's backward: plain tensor operations, any device and dtype)."""
    rows, h, w, d = q.shape
    step = max(1, _PROBABILITY_BYTES // (4 * h * w * w))
    if rows > step:
        parts = [
            _causal_attention_backward(*(x[i : i + step] for x in (g, q, k, v)))
            for i in range(0, rows, step)
        ]
        return tuple(torch.cat(p) for p in zip(*parts))
    group = h // k.shape[1]
    qf, gf = q.float(), g.float()
    kf, vf = (x.float().repeat_interleave(group, dim=1) for x in (k, v))  # (rows, H, W, D)
    scale = d**-0.5
    scores = qf @ kf.transpose(-1, -2) * scale
    future = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)
    p = scores.masked_fill_(future, float("-inf")).softmax(-1)  # (rows, H, W, W)
    dv = p.transpose(-1, -2) @ gf
    dp = gf @ vf.transpose(-1, -2)
    ds = p * (dp - (dp * p).sum(-1, keepdim=True))
    dq = ds @ kf * scale
    dk = ds.transpose(-1, -2) @ qf * scale
    dk, dv = (x.view(rows, -1, group, w, d).sum(2) for x in (dk, dv))  # back to K heads
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu_seqlens, max_seqlen, grids, slots, padding, kernel = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, grids, slots, padding)
    ctx.max_seqlen, ctx.kernel = max_seqlen, kernel


def _backward(ctx, grad, grad_lse):
    q, k, v, out, lse, cu_seqlens, grids, slots, padding = ctx.saved_tensors
    dq, dk, dv = segment_attention_backward(
        grad, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, grids, slots, padding, ctx.kernel
    )
    return dq, dk, dv, None, None, None, None, None, None


segment_attention.register_autograd(_backward, setup_context=_setup_context)


def _cat(pieces: list[Tensor]) -> Tensor:
    # One grid (whole-row documents, pad mode): its kernel's own output, nothing copied.
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces)).contiguous()


class Grids:
    """A plan's grids, read on the host: (n, heads, D) tokens in grid order to (rows, heads,
    width, D) grids (`place`; a full grid is a view of its tokens) and back (`take`)."""

    def __init__(self, like: Tensor, grids: Tensor, slots: Tensor, padding: Tensor) -> None:
        self.shapes = [tuple(g) for g in grids.tolist()]  # (rows, width, tokens) each
        self.counts = [count for _, _, count in self.shapes]
        padded = [(r * w, c) for r, w, c in self.shapes if c < r * w]
        slot_parts = iter(slots.split([c for _, c in padded]))
        pad_parts = iter(padding.split([size - c for size, c in padded]))
        self.places = [
            (next(slot_parts), next(pad_parts)) if c < r * w else None for r, w, c in self.shapes
        ]

    def place(self, x: Tensor) -> list[Tensor]:
        """(n, heads, ...) in grid order -> per grid (rows, heads, width, ...), a (rows, width)
        layout transposed; a padded grid's empty places hold zeros (finite: the rows they feed
        are discarded, and never turn a real token's gradient into NaN)."""
        out = []
        for piece, (rows, width, _), places in zip(x.split(self.counts), self.shapes, self.places):
            if places is not None:
                slots, padding = places
                full = piece.new_empty(rows * width, *piece.shape[1:]).index_fill_(0, padding, 0)
                piece = full.index_copy_(0, slots, piece)
            out.append(piece.reshape(rows, width, *piece.shape[1:]).transpose(1, 2))
        return out

    def take(self, i: int, x: Tensor) -> Tensor:
        """Grid ``i``'s (rows, width, ...) values of its tokens -> (n, ...) in grid order."""
        x = x.flatten(0, 1)
        places = self.places[i]
        return x if places is None else x.index_select(0, places[0])
