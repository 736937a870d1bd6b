"""Causal attention within segments of a flat token stream: one operator per layer.

``attend(q, k, v, plan)`` runs ``llama_ddp::segment_attention``, a ``torch.library.custom_op``
with a fake kernel and an autograd formula (its backward is a custom op too), so torch.compile
captures a whole decoder layer around it as one graph, activation checkpointing included, while
the segments change with every batch. Its kernels (the plan's backend, attention_plan/backends.py,
where the dtype and head size fit it):
- ``varlen``: CUDA in fp16/bf16: one call of torch's flash varlen op (``torch.nn.attention.varlen``;
  FlashAttention 2, or 3 or 4 where the run activated them), causal, grouped-query attention
  native, on the segments as ``cu_seqlens``, bound to the installed torch's schema of the op
  (varlen.py);
- ``cudnn``: CUDA in fp16/bf16 (SM 9.0+, cuDNN 9): the plan's bucketed grids, one causal call of
  cuDNN's attention per grid (``aten._scaled_dot_product_cudnn_attention``), its log-sum-exp kept
  for cuDNN's backward;
- ``grids``: CPU: the grids, one causal call of the CPU flash kernel per grid (the kernel
  ``F.scaled_dot_product_attention`` picks there), its log-sum-exp kept for the backward;
- ``sdpa``: elsewhere (CUDA in fp32, GPUs without flash, a torch without the op or with a
  schema of it varlen.py does not know): the grids through
  ``F.scaled_dot_product_attention``; the backward recomputes each grid's probabilities (a
  (rows, H, width, width) tensor at a time: correct everywhere, not the fast path).
Every kernel reads the plan's host tensor ``grids`` on the host or not at all: none waits for
the device.

Shapes: N tokens, H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llama_ddp.attention_plan import backends, varlen
from llama_ddp.attention_plan.plan import AttentionPlan

Tensor = torch.Tensor


def kernel_for(q: Tensor, plan: AttentionPlan) -> str:
    """The kernel of `segment_attention` for (N, H, D) ``q``: the plan's, where ``q``'s dtype and
    head size fit it, else the device's fallback."""
    if q.device.type == "cpu":
        return "grids"
    return plan.kernel if backends.kernel_fits(plan.kernel, q.dtype, q.shape[-1]) else "sdpa"


def attend(q: Tensor, k: Tensor, v: Tensor, plan: AttentionPlan) -> Tensor:
    """Causal attention of (N, H, D) queries over (N, K, D) keys/values within the plan's
    segments -> (N, H, D)."""
    return segment_attention(
        q,
        k,
        v,
        plan.cu_seqlens,
        plan.max_seqlen,
        plan.grids,
        plan.slots,
        plan.padding,
        kernel_for(q, plan),
    )[0]


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
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out (N, H, D), the log-sum-exp of each query's scores (float32: `varlen.lse_shape` for
    ``varlen``, (N, H) for ``grids``, none for ``sdpa``), and for the grids' backward the padded
    grids' region of q, k and v: (P, heads, D) each, P = its places (none for ``varlen``))."""
    if kernel == "varlen":  # torch's op, called as the installed torch defines it
        out, lse = varlen.installed().forward(q, k, v, cu_seqlens, max_seqlen)
        return out, lse, *(x.new_empty(0, *x.shape[1:]) for x in (q, k, v))
    grid = Grids(grids, slots, padding)
    regions = [grid.region(x) for x in (q, k, v)]
    outs, lses = [], []
    for qg, kg, vg in zip(*(grid.grids(x, r) for x, r in zip((q, k, v), regions))):
        if kernel == "grids":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                qg, kg, vg, 0.0, True
            )
            lses.append(lse.transpose(1, 2))  # (rows, width, H)
        elif kernel == "cudnn":
            out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
                qg, kg, vg, None, True, 0.0, True, False
            )[:2]
            lses.append(lse.reshape(qg.shape[:3]).transpose(1, 2))  # (rows, width, H)
        else:
            out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=True)
        outs.append(out.transpose(1, 2))  # (rows, width, H, D)
    lse = grid.take(lses) if lses else q.new_empty(0, dtype=torch.float32)
    return grid.take(outs), lse, *regions


@segment_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, grids, slots, padding, kernel):
    n, h, _ = q.shape
    lse = varlen.lse_shape(q, cu_seqlens, max_seqlen)
    shape = {"varlen": lse, "grids": (n, h), "cudnn": (n, h)}.get(kernel, (0,))
    places = 0 if kernel == "varlen" else slots.shape[0] + padding.shape[0]
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        q.new_empty(shape, dtype=torch.float32),
        *(x.new_empty(places, *x.shape[1:]) for x in (q, k, v)),
    )


@torch.library.custom_op("llama_ddp::segment_attention_backward", mutates_args=())
def segment_attention_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    q_region: Tensor,
    k_region: Tensor,
    v_region: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    grids: Tensor,
    slots: Tensor,
    padding: Tensor,
    kernel: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `segment_attention` for the output gradient ``grad``."""
    if kernel == "varlen":
        return varlen.installed().backward(grad, q, k, v, out, lse, cu_seqlens, max_seqlen)
    if kernel == "cudnn":  # its graphs are cached by q, k, v's strides alone: dO laid out as o
        grad = grad.contiguous()
    grid = Grids(grids, slots, padding)
    placed = [grid.grids(x, r) for x, r in ((q, q_region), (k, k_region), (v, v_region))]
    placed.append(grid.grids(grad, grid.region(grad)))
    if kernel in ("grids", "cudnn"):
        placed.append(grid.grids(out, grid.region(out)))
        lse = lse.unsqueeze(-1)  # (N, H, 1)
        placed.append(grid.grids(lse, grid.region(lse)))
    dq, dk, dv = [], [], []
    for tensors in zip(*placed):
        if kernel == "grids":
            qg, kg, vg, g, og, lse_g = tensors
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                g, qg, kg, vg, og, lse_g.squeeze(-1).contiguous(), 0.0, True
            )
        elif kernel == "cudnn":  # no dropout: its random state is unused, no bias
            qg, kg, vg, g, og, lse_g = tensors
            seed = torch.zeros((), dtype=torch.int64, device=qg.device)
            w = qg.shape[2]
            grads = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
                g, qg, kg, vg, og, lse_g.contiguous(), seed, seed, None, None, None, w, w, 0.0, True
            )
        else:
            qg, kg, vg, g = tensors
            grads = _causal_attention_backward(g, qg, kg, vg)
        for acc, d in zip((dq, dk, dv), grads):
            acc.append(d.transpose(1, 2))
    return tuple(grid.take(d) for d in (dq, dk, dv))


@segment_attention_backward.register_fake
def _(grad, q, k, v, out, lse, q_region, k_region, v_region, *plan):
    return tuple(torch.empty_like(x, memory_format=torch.contiguous_format) for x in (q, k, v))


_PROBABILITY_BYTES = varlen.PROBABILITY_BYTES


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
    out, lse, *regions = output
    ctx.save_for_backward(q, k, v, out, lse, *regions, cu_seqlens, grids, slots, padding)
    ctx.max_seqlen, ctx.kernel = max_seqlen, kernel
    ctx.mark_non_differentiable(lse, *regions)


def _backward(ctx, grad, *unused):
    q, k, v, out, lse, *regions, cu_seqlens, grids, slots, padding = ctx.saved_tensors
    dq, dk, dv = segment_attention_backward(
        grad, q, k, v, out, lse, *regions, cu_seqlens, ctx.max_seqlen, grids, slots, padding,
        ctx.kernel,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None


segment_attention.register_autograd(_backward, setup_context=_setup_context)


class Grids:
    """A plan's grids, read on the host. The padded grids (first in grid order) lie in one region
    (`region`: the tokens at their places, zeros elsewhere, for all of them in two operations);
    a full grid is a view of its tokens (`grids`); `take` brings each grid's values of its tokens
    back to (N, ...) in grid order."""

    def __init__(self, grids: Tensor, slots: Tensor, padding: Tensor) -> None:
        self.shapes = [tuple(g) for g in grids.tolist()]  # (rows, width, tokens) each
        self.slots, self.padding = slots, padding
        self.tokens = slots.shape[0]  # the padded grids' tokens, first in grid order
        # each padded grid's tokens' places in its own (rows * width) grid
        self.local, start, offset = [], 0, 0
        for rows, width, count in self.shapes:
            if count < rows * width:
                self.local.append(slots[start : start + count] - offset)
                start, offset = start + count, offset + rows * width

    def region(self, x: Tensor) -> Tensor:
        """(N, ...) tokens -> (P, ...) the padded grids' region (zeros: finite, so the rows they
        feed, which are discarded, never turn a real token's gradient into NaN)."""
        out = x.new_empty(self.slots.shape[0] + self.padding.shape[0], *x.shape[1:])
        return out.index_fill_(0, self.padding, 0).index_copy_(0, self.slots, x[: self.tokens])

    def grids(self, x: Tensor, region: Tensor) -> list[Tensor]:
        """Per grid (rows, heads, width, ...): a (rows, width) layout transposed, a view of the
        region (padded grids) or of the tokens ``x`` (full ones)."""
        out, offset, start = [], 0, self.tokens
        for rows, width, count in self.shapes:
            if count < rows * width:
                piece, offset = region[offset : offset + rows * width], offset + rows * width
            else:
                piece, start = x[start : start + count], start + count
            out.append(piece.reshape(rows, width, *piece.shape[1:]).transpose(1, 2))
        return out

    def take(self, pieces: list[Tensor]) -> Tensor:
        """Per grid (rows, width, ...) values -> (N, ...) those of its tokens, in grid order."""
        local = iter(self.local)
        taken = [
            x.flatten(0, 1)
            if count == rows * width
            else x.flatten(0, 1).index_select(0, next(local))
            for x, (rows, width, count) in zip(pieces, self.shapes)
        ]
        # One grid (whole-row documents, pad mode): its kernel's own output, nothing copied.
        return (taken[0] if len(taken) == 1 else torch.cat(taken)).contiguous()
