"""Where a batch's tokens sit: which ones the model computes, and which ones each attends to.

The model's per-token layers run on a flat stream of tokens; attention runs on grids of rows in
which a token's column is its RoPE position and plain causal attention is exact. A `Layout` maps
one to the other for right-padded rows (``real``) and for packed documents (``document_ids``).
Built on the CPU from the batch's masks, so no step waits for the device.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

# Causal attention of (rows, width, ...) q, k, v grids, a token's position its column.
Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def eager(fn: Callable) -> Callable:
    """``fn``, run eagerly under torch.compile: work on the CPU or with shapes that change with
    every batch would break the graph or recompile it each step. (torch.compiler.disable imports
    torch._dynamo, 1.3 s: only a compiling process pays for it.)"""
    return torch.compiler.disable(fn) if torch.compiler.is_compiling() else fn


class Layout:
    """Where the computed tokens of a batch sit, passed explicitly through the layers.

    The per-token layers (embedding, norms, projections, MLP, lm_head) run on the N computed
    tokens flat as (N, ...): every position, or with ``real`` (a (B, T) bool mask true on a
    prefix of each row: right padding) the real ones. Attention runs on grids of (rows, width)
    where a token's column is its RoPE position and causal attention is exact:
    - without ``document_ids``, one grid: the (B, T) rows themselves, tokens in row-major order;
    - with ``document_ids`` ((B, T) ints, non-decreasing along a row), each document's run in a
      row is a grid row of its own whose columns restart at 0, so every document attends as if
      alone. Runs are grouped by width (`bucket_widths`) into a few grids, one attention call
      each: attention costs what the documents need (sum of L^2), not the rows (B x T^2). The
      per-token layers take the tokens in grid order, so a grid whose rows are full (whole-row
      documents, most rows of a long-document corpus) is a view of them, nothing copied;
      `restore` puts the final hidden states back in row-major order.
    """

    def __init__(
        self,
        shape: tuple[int, int] | torch.Size,
        real: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> None:
        b, t = shape
        self.documents = document_ids is not None
        if document_ids is None:
            # Built where ``real`` lives (the CPU, for a batch's mask that stayed there: no
            # device sync), then moved to the model's device.
            index = real.flatten().nonzero().squeeze(1)
            order, self.grids, self.counts = None, [(b, t)], [len(index)]
            slots, padding = [index], [(~real).flatten().nonzero().squeeze(1)]
            positions = index % t
        else:
            # A batch's ids stay on the CPU like ``real``; ids on a GPU cost one sync here.
            ids = document_ids.cpu()
            if (ids[:, 1:] < ids[:, :-1]).any():
                raise ValueError("document_ids must be non-decreasing along each row")
            real = real.cpu() if real is not None else None
            index, first, lengths = _segments(shape, real, ids)
            order, positions, self.grids, self.counts, slots, padding = _plan(first, lengths, t)
            if order is not None:
                index = index[order]
            elif real is None:
                index = None  # every position, in order
        device = device or (real.device if document_ids is None else document_ids.device)

        def move(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x.to(device, non_blocking=True)

        self.index = move(index)  # the flat (B*T) position of each computed token, in order
        self.order = move(order)  # grid order -> row-major order among the computed tokens
        self.inverse = move(None if order is None else torch.argsort(order))
        self.positions = move(positions)  # each computed token's RoPE position, its column
        # Each grid's token places (None: all of them, in order) and empty places (zeroed).
        self.slots = [self.index if s is index else move(s) for s in slots]
        self.padding = [move(p) for p in padding]

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...): the computed tokens, in the layout's order."""
        x = x.flatten(0, 1)
        return x if self.index is None else x.index_select(0, self.index)

    def rope(self, tables: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(T, D) RoPE tables -> each computed token's own row, (N, 1, D) to broadcast over heads:
        RoPE runs once on the tokens, not on every grid (fewer, larger operations)."""
        return tuple(table.index_select(0, self.positions).unsqueeze(1) for table in tables)

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) in the layout's order -> (N, ...) in row-major order."""
        return x if self.order is None else _Reorder.apply(x, self.inverse, self.order)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """``attention`` (on (rows, width, ...) grids) of the flat (N, ...) q, k, v -> (N, ...)."""
        if self.documents:  # grids that change with every batch: eager under torch.compile
            return eager(self._attend)(q, k, v, attention)
        return self._attend(q, k, v, attention)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        if len(self.grids) == 1 and self.slots[0] is None:  # one full grid: views, no copies
            rows, width = self.grids[0]
            return attention(*(x.view(rows, width, -1) for x in (q, k, v))).flatten(0, 1)
        grids = zip(*(_ToGrids.apply(x, self) for x in (q, k, v)))
        out = [
            attention(*(x.view(rows, width, -1) for x in qkv)).flatten(0, 1)
            for qkv, (rows, width) in zip(grids, self.grids)
        ]
        return _FromGrids.apply(self, *out)


def _place(x: torch.Tensor, slots: torch.Tensor, padding: torch.Tensor, size: int) -> torch.Tensor:
    """(n, ...) -> (size, ...): row i of ``x`` at ``slots[i]``, zeros at ``padding`` (the rest)."""
    out = x.new_empty(size, *x.shape[1:]).index_fill_(0, padding, 0)
    return out.index_copy_(0, slots, x)


# Tokens into their grids and back, and into row-major order. Places never repeat, so each move's
# adjoint is the other: index_copy and index_select both ways (autograd's own adjoints, a
# scatter-add for index_select and a full-size zero buffer per slice, cost more than the attention
# saves on the CPU). A full grid is a view of the tokens. Empty places hold zeros: finite, so the
# discarded rows they feed never turn a real token's gradient into NaN.
class _ToGrids(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        pieces = x.split(layout.counts)
        return tuple(
            piece if slots is None else _place(piece, slots, padding, rows * width)
            for piece, slots, padding, (rows, width) in zip(
                pieces, layout.slots, layout.padding, layout.grids
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        slots = ctx.layout.slots
        pieces = [g if s is None else g.index_select(0, s) for g, s in zip(grads, slots)]
        return torch.cat(pieces), None


class _FromGrids(torch.autograd.Function):
    @staticmethod
    def forward(ctx, layout, *grids):
        ctx.layout = layout
        pieces = [g if s is None else g.index_select(0, s) for g, s in zip(grids, layout.slots)]
        return torch.cat(pieces)

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        pieces = grad.split(layout.counts)
        return None, *(
            piece if slots is None else _place(piece, slots, padding, rows * width)
            for piece, slots, padding, (rows, width) in zip(
                pieces, layout.slots, layout.padding, layout.grids
            )
        )


class _Reorder(torch.autograd.Function):
    """Rows of ``x`` taken in the order of ``index``, a permutation; ``inverse`` is its inverse."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _segments(
    shape: tuple[int, int] | torch.Size,
    real: torch.Tensor | None,
    document_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The computed tokens' places in the flat (B*T) positions (N,); for each attention segment
    (a row, a row's real prefix, or a document's run in a row) its first token's number among
    them (S,) and its length (S,). On the CPU."""
    b, t = shape
    keep = real if real is not None else torch.ones(b, t, dtype=torch.bool)
    starts = keep.clone()  # a segment starts at a row's first computed token or a new document
    if document_ids is None:
        starts[:, 1:] = False
    else:
        starts[:, 1:] &= document_ids[:, 1:] != document_ids[:, :-1]
    index = keep.flatten().nonzero().squeeze(1)
    first = starts.flatten()[index].nonzero().squeeze(1)
    lengths = torch.diff(first, append=torch.tensor([len(index)]))
    return index, first, lengths


def segment_lengths(
    shape: tuple[int, int] | torch.Size,
    real: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(S,) the lengths of the spans a batch's tokens attend within, as the model computes it:
    whole rows, the rows' real prefixes (``real``), or documents (``document_ids``)."""
    real = real.cpu() if real is not None else None
    ids = document_ids.cpu() if document_ids is not None else None
    return _segments(shape, real, ids)[2]


# A document's grid row is never narrower than this: tiny attention calls cost more than they save.
MIN_WIDTH = 16


def bucket_widths(lengths: torch.Tensor, limit: int) -> torch.Tensor:
    """The grid width of each segment length: rounded up to a multiple of an eighth of the next
    power of two (at most 4 widths per octave, each under 1.25 x the length, so attention wastes
    little on padding and runs in few calls), at least MIN_WIDTH, at most ``limit`` (the rows'
    width, so a batch of whole-row documents is exactly the plain layout)."""
    octave = torch.exp2(torch.ceil(torch.log2(lengths.double()))).long()  # next power of two
    step = (octave // 8).clamp(min=1)
    widths = (lengths + step - 1) // step * step
    return widths.clamp(min=MIN_WIDTH).clamp(max=limit)


def _plan(
    first: torch.Tensor, lengths: torch.Tensor, limit: int
) -> tuple[torch.Tensor | None, torch.Tensor, list, list, list, list]:
    """The grids of document runs (``first`` token, ``lengths``): runs grouped by width, full
    ones (length = width) apart from padded ones, narrowest first. Returns the token order (grid
    order -> row-major number; None if the same), each token's column in that order, the grids
    (rows, width), their token counts, and per grid its tokens' places and its empty places
    (both None for a full grid)."""
    widths = bucket_widths(lengths, limit)
    key = 2 * widths + (lengths < widths)  # a full and a padded grid of the same width
    runs = torch.argsort(key, stable=True)
    keys, rows = torch.unique_consecutive(key[runs], return_counts=True)
    lengths = lengths[runs]
    run = torch.repeat_interleave(torch.arange(len(runs)), lengths)  # of each token, in order
    column = torch.arange(len(run)) - (torch.cumsum(lengths, 0) - lengths)[run]
    order = first[runs][run] + column
    counts = torch.zeros(len(keys), dtype=torch.long).index_add_(
        0, torch.repeat_interleave(torch.arange(len(keys)), rows), lengths
    )
    grids = list(zip(rows.tolist(), (keys // 2).tolist()))
    slots, padding, start = [], [], 0
    for (n, width), count, padded in zip(grids, counts.tolist(), (keys % 2).tolist()):
        places = empty = None
        if padded:  # a run's tokens go to its own row of the grid, from column 0
            local_run = run[start : start + count] - run[start]
            places = local_run * width + column[start : start + count]
            empty = torch.ones(n * width, dtype=torch.bool)
            empty[places] = False
            empty = empty.nonzero().squeeze(1)
        slots.append(places)
        padding.append(empty)
        start += count
    identity = torch.equal(order, torch.arange(len(order)))
    return None if identity else order, column, grids, counts.tolist(), slots, padding
