"""The windows validation and perplexity score a document with."""

import numpy as np
import pytest
import torch

from llama_ddp.eval.windows import document_windows, window_rows, windows
from llama_ddp.model.loss import IGNORE_INDEX


@pytest.mark.parametrize("length", [1, 2, 3, 7, 16])
def test_every_target_once_with_its_context_up_to_the_window(length):
    stride = max(1, length // 2)
    for n in range(1, 60):
        spans = windows(n, length)
        scored = [t for s in spans for t in range(s.first + 1, s.end + 1)]
        assert scored == list(range(1, n))  # every target once, in order
        for s in spans:
            assert 0 <= s.start <= s.first < s.end <= n - 1
            assert s.end - s.start == min(length, n - 1)  # never longer than the text
            # a target sees all of its earlier tokens up to the window, at least length - stride
            assert s.first == 0 or s.first - s.start >= length - stride


def test_a_document_of_at_most_length_plus_one_tokens_is_one_window():
    assert windows(17, 16) == [(0, 16, 0)]
    assert windows(18, 16) == [(0, 16, 0), (1, 17, 16)]
    assert windows(40, 16, stride=16) == [(0, 16, 0), (16, 32, 16), (23, 39, 32)]
    with pytest.raises(ValueError, match="stride 17"):
        windows(40, 16, stride=17)


def test_rows_hold_the_windows_of_a_stream_of_documents():
    tokens = np.arange(100, 130)
    offsets = np.array([0, 5, 30])  # a 5-token and a 25-token document
    spans = document_windows(offsets, 16)
    assert spans.tolist() == [[0, 4, 0], [5, 21, 5], [13, 29, 21]]
    x, y, real = window_rows(tokens, spans, multiple=8)
    assert x.shape == y.shape == real.shape == (3, 16)
    assert real.sum(1).tolist() == [4, 16, 16]
    assert x[0, :4].tolist() == [100, 101, 102, 103] and y[0, :4].tolist() == [101, 102, 103, 104]
    assert (y[2, :8] == IGNORE_INDEX).all()  # context: the first window scored it
    assert y[2, 8:].tolist() == list(range(122, 130))
    assert torch.equal(y != IGNORE_INDEX, real & (y != IGNORE_INDEX))
