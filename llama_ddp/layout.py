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
    tokens flat as (N, ...) in row-major order: every position, or with ``real`` (a (B, T) bool
    mask true on a prefix of each row: right padding) the real ones. Attention runs on grids of
    (rows, width) where a token's column is its RoPE position and causal attention is exact:
    - without ``document_ids``, one grid: the (B, T) rows themselves;
    - with ``document_ids`` ((B, T) ints, non-decreasing along a row), each document segment of
      each row is a grid row of its own whose columns restart at 0, so every document attends as
      if alone. Segments are grouped by width (`bucket_widths`) into a few grids, one attention
      call each: the attention cost follows the documents (sum of L^2), not the rows (B x T^2).
    The grids lie back to back in one flat buffer; ``slots`` is each token's place in it.
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
            slots, self.grids = index, [(b, t)]
        else:
            # A batch's ids stay on the CPU like ``real``; ids on a GPU cost one sync here.
            ids = document_ids.cpu()
            if (ids[:, 1:] < ids[:, :-1]).any():
                raise ValueError("document_ids must be non-decreasing along each row")
            real = real.cpu() if real is not None else None
            index, first, lengths = _segments(shape, real, ids)
            slots, self.grids = _grid_slots(first, lengths, t)
            index = index if real is not None else None  # None: every position, in order
        device = device or slots.device
        self.slots = slots.to(device, non_blocking=True)
        self.index = index
        if index is slots:
            self.index = self.slots
        elif index is not None:
            self.index = index.to(device, non_blocking=True)

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...): the computed tokens."""
        x = x.flatten(0, 1)
        return x if self.index is None else x.index_select(0, self.index)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """``attention`` (on (rows, width, ...) grids) of the flat (N, ...) q, k, v -> (N, ...)."""
        qkv = torch.cat((q, k, v), dim=-1)
        sizes = (q.shape[-1], k.shape[-1], v.shape[-1])
        if self.documents:  # grids that change with every batch: eager under torch.compile
            return eager(self._attend)(qkv, sizes, attention)
        return self._attend(qkv, sizes, attention)

    def _attend(
        self, qkv: torch.Tensor, sizes: tuple[int, ...], attention: Attention
    ) -> torch.Tensor:
        buffer = self.to_grid(qkv)
        out, start = [], 0
        for rows, width in self.grids:
            grid = buffer[start : start + rows * width].view(rows, width, -1)
            out.append(attention(*grid.split(sizes, dim=-1)).flatten(0, 1))
            start += rows * width
        return (out[0] if len(out) == 1 else torch.cat(out)).index_select(0, self.slots)

    def to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) -> (slots, ...): the grids back to back, zeros in the empty slots.
        Differentiable."""
        size = sum(rows * width for rows, width in self.grids)
        return x.new_zeros(size, *x.shape[1:]).index_copy(0, self.slots, x)


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


def _grid_slots(
    first: torch.Tensor, lengths: torch.Tensor, limit: int
) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Each token's slot in the flat buffer of grids, and the grids (rows, width) in buffer order:
    segments grouped by width, narrowest first, one grid row each, columns from 0."""
    widths = bucket_widths(lengths, limit)
    order = torch.argsort(widths, stable=True)
    grid_width, grid_rows = torch.unique_consecutive(widths[order], return_counts=True)
    grid_start = torch.cumsum(grid_width * grid_rows, 0) - grid_width * grid_rows
    grid = torch.repeat_interleave(torch.arange(len(grid_rows)), grid_rows)  # of sorted segments
    row = torch.arange(len(order)) - (torch.cumsum(grid_rows, 0) - grid_rows)[grid]
    segment_slot = torch.empty_like(lengths)
    segment_slot[order] = grid_start[grid] + row * grid_width[grid]
    segment = torch.repeat_interleave(torch.arange(len(lengths)), lengths)  # of each token
    column = torch.arange(len(segment)) - first[segment]
    grids = list(zip(grid_rows.tolist(), grid_width.tolist()))
    return segment_slot[segment] + column, grids
