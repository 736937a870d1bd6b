"""Scoring windows: how validation and perplexity see a document.

Every target of a document (``[BOT] tokens [EOT]``, n tokens, n - 1 targets) is scored exactly
once, with all of its own earlier context up to the window length L: a document of at most L + 1
tokens is one window of n - 1 inputs (pad mode's row, never longer than the text); a longer one
goes on in windows of L inputs that each score the next ``stride`` targets (L // 2 by default)
after carrying the L - stride tokens before them as context, as a strided perplexity does. A
window is never padded to L: its rows are as long as its tokens, and the model computes their real
positions only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from llama_ddp.attention_plan.plan import IGNORE_INDEX
from llama_ddp.data.batch import Batch


class Window(NamedTuple):
    """Inputs ``tokens[start:end]``, targets ``tokens[start + 1:end + 1]``; the targets after
    ``tokens[first]`` are scored (``first >= start``), the ones before are context."""

    start: int
    end: int
    first: int


def windows(n: int, length: int, stride: int | None = None) -> list[Window]:
    """The windows scoring a document of ``n`` tokens (see the module docstring)."""
    if length < 1:
        raise ValueError(f"window length {length} must be >= 1")
    stride = stride or max(1, length // 2)
    if not 1 <= stride <= length:
        raise ValueError(f"stride {stride} must be in [1, {length}]")
    last = n - 1  # the index of the last target
    if last < 1:
        return []
    end = min(length, last)
    out = [Window(0, end, 0)]
    while end < last:
        first, end = end, min(end + stride, last)
        out.append(Window(end - length, end, first))
    return out


def document_windows(offsets: np.ndarray, length: int) -> np.ndarray:
    """(W, 3) the windows of every document of a token stream whose documents start at
    ``offsets`` (one more than the documents), as absolute (start, end, first) positions, in
    document order."""
    rows = [
        (a + w.start, a + w.end, a + w.first)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())
        for w in windows(b - a, length)
    ]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 3)


def window_rows(
    tokens: np.ndarray | torch.Tensor, spans: np.ndarray, multiple: int = 16, limit: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The windows ``spans`` ((rows, 3) absolute start, end, first) of ``tokens`` as one batch:
    ``x`` (rows, T) inputs and ``y`` targets, right-padded, with IGNORE_INDEX on context and
    padding, and ``computed`` (rows, T) true on each row's inputs (a prefix: the positions to
    compute). T is the longest window rounded up to ``multiple`` (few distinct shapes), at most
    ``limit`` (the window length) when given."""
    spans = np.asarray(spans, dtype=np.int64).reshape(-1, 3)
    lengths = spans[:, 1] - spans[:, 0]
    width = -(-int(lengths.max()) // multiple) * multiple
    width = min(width, limit) if limit else width
    x = torch.zeros(len(spans), width, dtype=torch.long)
    y = torch.full((len(spans), width), IGNORE_INDEX, dtype=torch.long)
    computed = torch.zeros(len(spans), width, dtype=torch.bool)
    for row, (start, end, first) in enumerate(spans.tolist()):
        n = end - start
        x[row, :n] = torch.as_tensor(np.asarray(tokens[start:end], dtype=np.int64))
        scored = torch.as_tensor(np.asarray(tokens[first + 1 : end + 1], dtype=np.int64))
        y[row, first - start : n] = scored
        computed[row, :n] = True
    return x, y, computed


def window_batch(
    tokens: np.ndarray | torch.Tensor, spans: np.ndarray, limit: int, multiple: int = 16
) -> Batch:
    """The windows ``spans`` of ``tokens`` as a Batch (`window_rows`, at most ``limit`` wide):
    rows computed on their real positions only, each attending within itself (a one-token row
    without a target when there are none), logits at the scored positions only (``rows``: a
    window's context gets none). Validation's and perplexity's batches."""
    if len(spans) == 0:
        x, y = torch.zeros(1, 1, dtype=torch.long), torch.full((1, 1), IGNORE_INDEX)
        computed = torch.ones(1, 1, dtype=torch.bool)
    else:
        x, y, computed = window_rows(tokens, spans, multiple, limit)
    rows = torch.zeros(x.shape, dtype=torch.long)  # one document per row
    return Batch.of(x, y, padded=True, document_ids=rows, computed=computed, scored_only=True)
