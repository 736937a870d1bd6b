"""Where a batch's tokens sit and which ones each attends to: the batch's attention plan, and
the label of a target nothing is learned from (``IGNORE_INDEX``). The contract between the data
layer, which builds batches, and the model, which reads them; it imports only torch.

The model's per-token layers run on a flat stream of the N tokens it computes; attention runs on
segments of that stream (a document, or a right-padded row's computed prefix), each causal and
alone. `plan_attention` works it all out on the CPU, in the loader's collate function, from the
batch's masks; the plan is pinned with the batch and moved to the device once per micro-batch
(`AttentionPlan.to`), so the model's forward never reads the device back and never copies from the
host. What each attention kernel needs (llama_ddp.model.attention) is in it: the segments'
boundaries (``cu_seqlens``, ``max_seqlen``) for CUDA's flash varlen kernel, the bucketed grids
for the CPU's, each token's RoPE position for both.
"""

from __future__ import annotations

import torch

from llama_ddp.attention_plan import backends, varlen

# A target equal to this adds nothing to the loss (torch's cross_entropy default ignore_index).
IGNORE_INDEX = -100

# A document's grid row is never narrower than this: tiny attention calls cost more than they save.
MIN_WIDTH = 16


class AttentionPlan:
    """The computed tokens of a (B, T) batch and the segments they attend within.

    The per-token layers (embedding, norms, projections, MLP, lm_head) take the N computed tokens
    flat, as (N, ...), in the plan's order (`tokens`): every position, or with ``computed`` (pad
    mode: a (B, T) bool mask true on a prefix of each row) the positions it holds. Attention runs on
    segments of that order, contiguous in it: ``cu_seqlens`` (S + 1,) int32 are their boundaries and
    ``max_seqlen`` the longest. For the CPU kernel the segments are also rows of grids ``(rows,
    width)`` in which a token's column is its RoPE position and plain causal attention is exact:
    each document a row of its own, rows grouped by width (`bucket_widths`) into a few grids, one
    attention call each, so attention costs what the documents need (sum of L^2), not the rows (B x
    T^2). The tokens come in grid order, so a grid whose rows are full (whole-row documents, most
    rows of a long-document corpus) is a view of them, nothing copied; `restore` puts the final
    hidden states back in row-major order. Pad mode keeps one (B, T) grid.

    A plain class, not a dataclass: DDP's and FSDP's input moves and casts pass it untouched.
    """

    def __init__(
        self,
        shape: tuple[int, int],
        *,
        subset: bool,
        index: torch.Tensor | None,
        order: torch.Tensor | None,
        positions: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        grids: torch.Tensor,
        slots: torch.Tensor,
        padding: torch.Tensor,
        spans: tuple[int, int],
        source: tuple[torch.Tensor | None, torch.Tensor | None],
    ) -> None:
        index, order, positions, cu_seqlens, grids, slots, padding = (
            own(t) for t in (index, order, positions, cu_seqlens, grids, slots, padding)
        )
        self.shape = shape
        self.subset = subset  # only some positions are computed: outputs are (N, ...)
        self.index = index  # (N,) the flat (B*T) place of each computed token; None: all, in order
        self.order = order  # (N,) plan order -> row-major order; None: the same
        self.inverse = None if order is None else torch.argsort(order)
        self.positions = positions  # (N,) each token's RoPE position
        self.cu_seqlens = cu_seqlens  # (S + 1,) int32 segment boundaries in plan order
        self.max_seqlen = max_seqlen
        # (G, 3) rows, width, tokens of each grid: read on the host by the CPU kernel, never moved
        self.grids = grids
        # The padded grids (first in grid order) lie in one region, grid after grid: the places
        # of their tokens there, and the empty places (zeroed).
        self.slots = slots
        self.padding = padding
        self.spans = spans  # (tokens, sum of squared segment lengths): the FLOPs, on the host
        self.source = source  # (computed, document_ids) on the host, to plan a part of the rows
        self.kernel = (
            "grids"  # set by `to`: the kernel of the backend the device runs (backends.py)
        )

    _MOVED = ("index", "order", "inverse", "positions", "cu_seqlens", "slots", "padding")

    def _replace(self, fn) -> AttentionPlan:
        plan = object.__new__(AttentionPlan)
        plan.__dict__.update(self.__dict__)
        for name in self._MOVED:
            value = getattr(self, name)
            setattr(plan, name, None if value is None else fn(value))
        return plan

    def to(self, device: torch.device) -> AttentionPlan:
        """The plan on ``device``: one non-blocking copy per tensor (from pinned memory when the
        loader pins), before the model is called; ``grids`` stays on the host."""
        device = torch.device(device)
        if device.type == "cpu":
            return self
        plan = self._replace(lambda t: t.to(device, non_blocking=True))
        plan.kernel = backends.current_kernel(device)
        return plan

    def record_stream(self, stream: torch.cuda.Stream) -> None:
        """Mark the device tensors as used on ``stream`` (see `Batch.record_stream`)."""
        for name in self._MOVED:
            value = getattr(self, name)
            if value is not None and value.is_cuda:
                value.record_stream(stream)

    def pin_memory(self) -> AttentionPlan:
        return self._replace(torch.Tensor.pin_memory)

    def rows(self, start: int, stop: int) -> AttentionPlan:
        """The plan of rows ``start:stop`` alone, on the host (DataParallel's replicas)."""
        computed, ids = self.source
        cut = slice(start, stop)
        return plan_attention(
            (stop - start, self.shape[1]),
            None if computed is None else computed[cut],
            None if ids is None else ids[cut],
        )

    # On the device, inside the model's forward: index arithmetic only.

    def tokens(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (N, ...): the computed tokens, in the plan's order."""
        x = x.flatten(0, 1)
        return x if self.index is None else x.index_select(0, self.index)

    def rope(self, tables: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """(T, D) RoPE tables -> each computed token's own row, (N, 1, D) to broadcast over heads:
        RoPE runs once on the tokens, not on every grid (fewer, larger operations)."""
        return tuple(table.index_select(0, self.positions).unsqueeze(1) for table in tables)

    def restore(self, x: torch.Tensor) -> torch.Tensor:
        """(N, ...) in the plan's order -> (N, ...) in row-major order."""
        return x if self.order is None else _Reorder.apply(x, self.inverse, self.order)

    def in_order(self, labels: torch.Tensor) -> torch.Tensor:
        """The inverse of `restore` for the targets, one per output row in row-major order ->
        (N,) in the plan's order."""
        labels = labels.flatten()
        return labels if self.order is None else labels.index_select(0, self.order)


def own(t: torch.Tensor | None) -> torch.Tensor | None:
    """A tensor of its own, not a view: torch.compile guards on a view's base."""
    return t if t is None or t._base is None else t.clone()


def flash_varlen_supported(device: torch.device) -> bool:
    """Whether ``device`` runs torch's flash varlen attention: CUDA, compute capability 8+, and a
    torch whose varlen ops llama_ddp knows (varlen.py: 2.10 and later)."""
    return device.type == "cuda" and varlen.device_problem(device) is None


class _Reorder(torch.autograd.Function):
    """Rows of ``x`` taken in the order of ``index``, a permutation; ``inverse`` is its inverse.
    (autograd's own adjoint of index_select, a scatter-add, costs far more on the CPU.)"""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def plan_attention(
    shape: tuple[int, int] | torch.Size,
    computed: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> AttentionPlan:
    """The attention plan of a (B, T) batch (on the CPU): with ``computed`` the positions of
    right-padded rows (one grid), with ``document_ids`` ((B, T) ints non-decreasing along each
    row) the rows' documents, each attending alone (grids by width); both may be given."""
    b, t = shape
    computed = computed.cpu() if computed is not None else None
    ids = document_ids.cpu() if document_ids is not None else None
    if ids is not None and (ids[:, 1:] < ids[:, :-1]).any():
        raise ValueError("document_ids must be non-decreasing along each row")
    index, first, lengths = _segments((b, t), computed, ids)
    spans = (int(lengths.sum()), int((lengths * lengths).sum()))
    if ids is None:  # right padding only: the (B, T) rows are the one grid
        order, positions, grids = None, index % t, [(b, t, len(index))]
        full = len(index) == b * t
        slots = _none() if full else index.clone()
        padding = _none() if full else (~computed).flatten().nonzero().squeeze(1)
    else:
        order, positions, grids, slots, padding, lengths = _plan(first, lengths, t)
        if order is not None:
            index = index[order]
        elif computed is None:
            index = None  # every position, in order
    lengths = lengths[lengths > 0]
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return AttentionPlan(
        (b, t),
        subset=computed is not None,
        index=index,
        order=order,
        positions=positions,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lengths.max()) if len(lengths) else 0,
        grids=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3),
        slots=slots,
        padding=padding,
        spans=spans,
        source=(computed, ids),
    )


def _none() -> torch.Tensor:
    return torch.empty(0, dtype=torch.int64)


def _segments(
    shape: tuple[int, int] | torch.Size,
    computed: torch.Tensor | None,
    document_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The computed tokens' places in the flat (B*T) positions (N,); for each attention segment
    (a row, a row's computed prefix, or a document's run in a row) its first token's number among
    them (S,) and its length (S,). On the CPU."""
    b, t = shape
    keep = computed if computed is not None else torch.ones(b, t, dtype=torch.bool)
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
    computed: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """(S,) the lengths of the spans a batch's tokens attend within, as the model computes it:
    whole rows, the rows' computed prefixes (``computed``), or documents (``document_ids``)."""
    computed = computed.cpu() if computed is not None else None
    ids = document_ids.cpu() if document_ids is not None else None
    return _segments(shape, computed, ids)[2]


def bucket_widths(lengths: torch.Tensor, limit: int) -> torch.Tensor:
    """The grid width of each segment length: rounded up to a multiple of an eighth of the next
    power of two (at most 4 widths per octave, each under 1.25 x the length, so attention wastes
    little on padding and runs in few calls), at least MIN_WIDTH, at most ``limit`` (the rows'
    width, so a batch of whole-row documents is exactly the plain layout)."""
    octave = torch.exp2(torch.ceil(torch.log2(lengths.double()))).long()  # next power of two
    step = (octave // 8).clamp(min=1)
    widths = (lengths + step - 1) // step * step
    return widths.clamp(min=MIN_WIDTH).clamp(max=limit)


def _plan(first: torch.Tensor, lengths: torch.Tensor, limit: int) -> tuple:
    """The grids of document runs (``first`` token, ``lengths``): runs grouped by width, padded
    grids (a run shorter than its width) first, then full ones (length = width), narrowest first
    in each. The padded grids lie in one region, grid after grid, each run a row of its grid
    from column 0. Returns the token order (grid order -> row-major number; None if the same),
    each token's column in that order, the grids (rows, width, tokens), the padded grids' token
    places and empty places in their region, and the runs' lengths in grid order."""
    widths = bucket_widths(lengths, limit)
    full = lengths == widths
    key = full * (limit + 1) + widths
    runs = torch.argsort(key, stable=True)
    keys, rows = torch.unique_consecutive(key[runs], return_counts=True)
    lengths, widths = lengths[runs], widths[runs]
    run = torch.repeat_interleave(torch.arange(len(runs)), lengths)  # of each token, in order
    column = torch.arange(len(run)) - (torch.cumsum(lengths, 0) - lengths)[run]
    order = first[runs][run] + column
    counts = torch.zeros(len(keys), dtype=torch.long).index_add_(
        0, torch.repeat_interleave(torch.arange(len(keys)), rows), lengths
    )
    grids = list(zip(rows.tolist(), (keys % (limit + 1)).tolist(), counts.tolist()))
    padded_runs = int((~full).sum())
    row_start = torch.cumsum(widths[:padded_runs], 0) - widths[:padded_runs]
    tokens = int(lengths[:padded_runs].sum())
    slots = row_start[run[:tokens]] + column[:tokens]
    empty = torch.ones(int(widths[:padded_runs].sum()), dtype=torch.bool)
    empty[slots] = False
    identity = torch.equal(order, torch.arange(len(order)))
    return None if identity else order, column, grids, slots, empty.nonzero().squeeze(1), lengths
