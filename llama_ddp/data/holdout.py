"""The hold-out of a source without a validation split of its own: which documents of its train
split are validation, decided in one pass over the documents in order, so that the train side and
the validation side (each read on its own, streaming or not, at any world size) agree.

Every k-th document is held out (index i with i % k == 0), at most `MAX_HOLDOUT_DOCS` of them, so
that a 10B-token corpus does not evaluate on 100M tokens. A document that would take the held-out
text past a bounded share of the text read so far (`MAX_SHARE` times 1/k, at least
`FLOOR_CHARS` characters in all) is kept for training instead, and the next document is held out
in its place: one huge document (a 17 MB line at index 200 among small ones) would otherwise be
most of validation and none of training. Where no document is that large the rule is the plain
every-k-th one, so the split (and the token cache keyed by it) is what it always was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

MAX_HOLDOUT_DOCS = 2000
MAX_SHARE = 5  # times the expected share, 1/k: what the sampling of documents never reaches
FLOOR_CHARS = 4_000_000  # held-out characters always allowed (~1M tokens; a long book's 3M)


def holdout(
    texts: Iterable[str | None], every: int, most: int = MAX_HOLDOUT_DOCS
) -> Iterator[tuple[str | None, bool]]:
    """Each of ``texts`` (in order) with whether it is held out, one of every ``every``: a
    document of index i % every == 0 (or the next one after a document kept for its size),
    while i < every * ``most``, unless it would take the held-out characters past
    max(FLOOR_CHARS, min(0.9, MAX_SHARE / every) x the characters read so far, its own too)."""
    end, share = every * most, min(0.9, MAX_SHARE / every)
    held = seen = 0
    deferred = False  # the last candidate was kept for training: this document is one
    for i, text in enumerate(texts):
        size = len(text) if text else 0
        seen += size
        candidate = i < end and (deferred or i % every == 0)
        taken = candidate and held + size <= max(FLOOR_CHARS, share * seen)
        deferred = candidate and not taken
        held += size if taken else 0
        yield text, taken
