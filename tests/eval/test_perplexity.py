"""perplexity.py: exp of the mean NLL over strided windows, documents each framed and scored
alone. `generate --perplexity`: tests/test_generate.py."""

import math

import pytest
import torch

from llama_ddp.data.tokenizer_files import special_ids
from llama_ddp.eval.perplexity import documents_nll, perplexity
from tests.helpers.runs import tiny


def direct_perplexity(model, ids, length):
    """Each target alone, from its own forward over the context the windows give it: all earlier
    tokens while it is among the first ``length`` targets; after that, the ``length`` inputs of
    the window (stride length // 2) that scores it, which ends at the window's last target."""
    stride, last = max(1, length // 2), len(ids) - 1
    nll = 0.0
    for i in range(1, last + 1):  # predict ids[i] from ids[start:i]
        start = 0
        if i > length:
            end = min(length + -(-(i - length) // stride) * stride, last)
            start = end - length
            assert 0 < i - start <= length and (i - start >= length - stride or end == last)
        with torch.no_grad():
            logp = model(torch.tensor([ids[start:i]]))[0, -1].double().log_softmax(-1)
        nll -= logp[ids[i]].item()
    return math.exp(nll / last)


def test_perplexity_is_exp_mean_nll(tok):
    model = tiny(tok.get_vocab_size())
    ids = torch.randint(0, tok.get_vocab_size(), (50,), generator=torch.Generator().manual_seed(0))
    ids = ids.tolist()
    for length, batch in [(16, 2), (16, 1), (7, 3), (49, 1), (256, 4)]:  # 49 targets
        expected = direct_perplexity(model, ids, length)
        assert perplexity(model, ids, length, batch) == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="seq_length"):
        perplexity(model, ids, 257)


def test_perplexity_never_computes_a_window_longer_than_the_text(tok):
    """A 50-token text under a 256-position model: one row of its 49 inputs, all of them real,
    not a window of 256 padded ones; a longer text's last window is as long as its tokens, and
    the lm_head runs on the positions a window scores only (not on its context)."""
    model = tiny(tok.get_vocab_size())
    shapes, head = [], []
    model.base_model.norm.register_forward_hook(lambda m, a, out: shapes.append(tuple(out.shape)))
    model.lm_head.register_forward_hook(lambda m, args, out: head.append(tuple(args[0].shape)))
    perplexity(model, list(range(50)))
    assert shapes == head == [(49, 64)]  # 49 computed tokens of width 64, all scored
    shapes.clear(), head.clear()
    perplexity(model, list(range(50)), 40, batch_size=1)  # windows [0, 40), [9, 49)
    assert shapes == [(40, 64), (40, 64)]
    assert head == [(40, 64), (9, 64)]  # the second window scores its last 9 targets


def test_documents_are_each_framed_as_in_training_and_scored_alone(tok):
    model = tiny(tok.get_vocab_size())
    ids = special_ids(tok)
    docs = ["def a():\n    pass\n", "x = 1\n"]
    streams = [[ids.bot, *tok.encode(d).ids, ids.eot] for d in docs]
    total, count = documents_nll(model, tok, ids, docs, 16, 2)
    assert count == sum(len(s) - 1 for s in streams)
    expected = sum(math.log(perplexity(model, s, 16)) * (len(s) - 1) for s in streams)
    assert total == pytest.approx(expected, rel=1e-6)
