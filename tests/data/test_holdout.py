"""data/holdout.py: the hold-out of a source without a validation split: every k-th document, a
bounded share of the text (a huge document is kept for training, the next one held out), the
plain every-k-th rule wherever no document is huge."""

import json
import random

import pytest

from llama_ddp.data.corpus import load_splits
from llama_ddp.data.holdout import FLOOR_CHARS, holdout


class Sized:
    """A document of ``n`` characters, without holding them."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __bool__(self) -> bool:
        return self.n > 0


def held(sizes, every, most=2000):
    return [i for i, (_, h) in enumerate(holdout(map(Sized, sizes), every, most)) if h]


def test_a_huge_document_is_kept_for_training_and_the_next_one_held_out(tmp_path):
    """Issue 60, item 11: a 17 MB one-line document at index 200 of small ones was held out by
    the every-100th rule: 99.8% of the text was validation. Now it trains, document 201 is held
    out in its place, and validation is under 1% of the text, streaming or not (6 MB here: any
    document past FLOOR_CHARS that would be most of validation)."""
    docs = [f"document {i}: " + "some words " * 20 for i in range(300)]
    docs[200] = "x" * 6_000_000
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    for streaming in (False, True):
        corpus = load_splits(str(path), cache_dir=tmp_path / "cache", streaming=streaming)
        validation = list(corpus.validation)
        assert validation == [docs[0], docs[100], docs[201]]
        assert list(corpus.train) == [d for i, d in enumerate(docs) if i not in (0, 100, 201)]
        total = sum(map(len, docs))
        assert sum(map(len, validation)) / total < 0.01


def test_where_no_document_is_huge_the_split_is_every_kth(tmp_path):
    """Existing users' splits (and the token caches keyed by them) are unchanged: documents of
    lengths drawn from heavy-tailed laws, up to 3M characters each, give exactly the
    every-k-th hold-out at every k; so do a few long books, held out up to FLOOR_CHARS."""
    for seed in range(10):
        rng = random.Random(seed)
        sizes = [min(3_000_000, int(2000 * rng.paretovariate(1.2))) for _ in range(20_000)]
        for every in (2, 10, 100):
            assert held(sizes, every) == list(range(0, 20_000, every)[:2000]), (seed, every)
    books = [3_000_000] * 10  # ten long books: the first is validation, as before
    assert held(books, 100) == [0]
    assert held([FLOOR_CHARS + 1, *books], 100) == [1]  # one larger than the floor: the next
    assert held([5, 1, 2, 3, 4, 6], 2, most=2) == [0, 2]  # at most `most` documents


@pytest.mark.parametrize("every", [2, 3, 10, 100])
def test_validation_stays_a_bounded_share_of_the_text_read(every):
    """Whatever the lengths (huge ones among small, in any order), the held-out text never
    passes max(FLOOR_CHARS, min(0.9, 5 / k) of the text read so far), at every prefix."""
    rng = random.Random(every)
    sizes = [rng.choice([10, 1_000, 50_000, 20_000_000]) for _ in range(3_000)]
    taken = set(held(sizes, every))
    kept = seen = 0
    for i, size in enumerate(sizes):
        seen += size
        kept += size if i in taken else 0
        assert kept <= max(FLOOR_CHARS, min(0.9, 5 / every) * seen)
    assert len(taken) >= len(sizes) // every // 2  # and it still holds out documents
