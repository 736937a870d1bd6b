"""batch.py: Batch, collate, the pad and pack datasets; the Prefetcher, which makes the next
step's batch while this step runs."""

import threading
import time

import numpy as np
import pytest
import torch

from llama_ddp.attention_plan.plan import plan_attention
from llama_ddp.data import pipeline as data_mod
from llama_ddp.data.batch import Prefetcher
from llama_ddp.data.pipeline import (
    IGNORE_INDEX,
    make_loader,
)
from tests.helpers.token_data import (
    BOT,
    EOT,
    LONG,
    PAD,
    SHORT,
    batches_of,
    build,
    framed,
    item,
    make_corpus,
)


def test_pad_frames_pads_shifts_and_ignores_pad_targets(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    train_texts = list(corpus.train)
    i = train_texts.index(SHORT)
    x, y = train[i]
    t = framed(tiny_tokenizer, SHORT)
    n = len(t)
    assert n < 17
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (16,)
    assert x.tolist() == t + [PAD] * (16 - n)
    assert y.tolist() == t[1:] + [IGNORE_INDEX] * (17 - n)
    assert len(train) == len(train_texts)


def test_pad_clips_long_documents_without_eot(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    x, y = train[list(corpus.train).index(LONG)]
    assert item(x, y) == framed(tiny_tokenizer, LONG)[:17]
    assert EOT not in item(x, y) and IGNORE_INDEX not in y.tolist()


def test_pack_windows_concatenate_to_the_stream_prefix(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    for split, (ds, texts_) in zip(
        ("train", "validation"),
        zip(
            build(
                tmp_path, corpus, tiny_tokenizer, seq_length=7, packing="pack", document_mask=False
            ),
            (corpus.train, corpus.validation),
        ),
    ):
        stream = [t for text in texts_ for t in framed(tiny_tokenizer, text)]
        assert len(ds) == len(stream) // 8, split
        windows = [item(*ds[i]) for i in range(len(ds))]
        assert [t for w in windows for t in w] == stream[: len(ds) * 8]
        x, y = ds[0]
        assert x[1:].tolist() == y[:-1].tolist()


def test_pack_windows_number_their_documents_and_ignore_targets_across_them(
    tmp_path, tiny_tokenizer, texts
):
    corpus = make_corpus(tmp_path, texts)
    masked, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=7, packing="pack")
    plain, _ = build(
        tmp_path, corpus, tiny_tokenizer, seq_length=7, packing="pack", document_mask=False
    )
    assert len(masked.split.shards) == 1  # a small corpus is one shard: its windows
    masked, plain = masked.part(0), plain.part(0)
    assert masked.document_mask and not plain.document_mask  # on by default
    offsets = masked.split.offsets
    document = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))  # of each stream token
    continued = ignored = 0
    for i in range(len(masked)):
        ids, docs = masked.document_ids(i), document[i * 8 : (i + 1) * 8]
        assert ids.tolist() == (docs - docs[0]).tolist()  # from 0 at the window's first token
        continued += i > 0 and docs[0] == document[i * 8 - 1]  # cut by the window's start
        (x, y), (plain_x, plain_y) = masked[i], plain[i]
        assert torch.equal(x, plain_x)
        across = ids[1:] != ids[:-1]  # y[k] begins another document than x[k]'s
        assert torch.equal(y[~across], plain_y[~across]) and (y[across] == IGNORE_INDEX).all()
        assert (plain_y[across] == BOT).all()
        ignored += int(across.sum())
    assert continued > 0 and ignored > 0
    # A window that starts inside a long document: that document is its document 0.
    i = next(i for i in range(1, len(masked)) if document[i * 8] == document[i * 8 - 1])
    assert masked.document_ids(i)[0] == 0 and masked[i][0][0] != BOT
    # The loader's batches carry x's ids, which stay on the CPU when the batch moves.
    sampler = batches_of(len(masked), 4, shuffle=False)
    batch = next(iter(make_loader(masked, sampler)))
    assert [masked.targets(i) for i in range(4)] == (batch.y != IGNORE_INDEX).sum(1).tolist()
    assert torch.equal(
        batch.document_ids, torch.stack([masked.document_ids(i)[:-1] for i in range(4)])
    )
    assert torch.equal(batch.y, torch.stack([masked[i][1] for i in range(4)]))
    assert batch.targets == int((batch.y != IGNORE_INDEX).sum()) and batch.computed is None
    moved = batch.to(torch.device("meta"))
    assert moved.x.is_meta and moved.labels.is_meta and moved.document_ids is batch.document_ids
    # The collate function planned the attention on the CPU; the plan moves with the batch.
    plan = plan_attention(batch.x.shape, document_ids=batch.document_ids)
    assert torch.equal(batch.plan.cu_seqlens, plan.cu_seqlens) and batch.spans == plan.spans
    assert moved.plan.cu_seqlens.is_meta and moved.plan.positions.is_meta


def test_pad_mode_and_plain_packing_need_no_document_ids(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    for packing, mask in (("pad", True), ("pad", False), ("pack", False)):
        train, _ = build(tmp_path, corpus, tiny_tokenizer, packing=packing, document_mask=mask)
        sampler = batches_of(len(train), 4, shuffle=False)
        batch = next(iter(make_loader(train, sampler, padded=packing == "pad")))
        assert batch.document_ids is None, (packing, mask)
        # pad: a plan of the real positions; plain causal packing: none (every position)
        assert (batch.plan is None) == (packing == "pack"), (packing, mask)
        width = batch.x.shape[1]  # pad batches are cut after their longest document
        assert torch.equal(batch.x, torch.stack([train[i][0][:width] for i in range(4)]))


def test_loader_stacks_micro_batches(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    # whole global batches of 4, as micro-batches of 2
    sampler = batches_of(len(train) - len(train) % 4, 2)
    batches = list(make_loader(train, sampler, padded=True))
    assert len(batches) == 2 * (len(train) // 4)
    batch = batches[0]
    assert batch.x.shape == batch.y.shape == (2, 16) and batch.x.dtype == torch.int64
    first = next(iter(sampler))
    assert torch.equal(batch.x, torch.stack([train[i][0] for i in first]))
    # pad mode: the real-target mask, the labels of the model's rows, their count
    assert torch.equal(batch.computed, batch.y != IGNORE_INDEX)
    assert torch.equal(batch.labels, batch.y[batch.computed]) and batch.targets == len(batch.labels)


def right_padded(lengths: list[int], width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pad-mode batch: row i has lengths[i] real targets, then IGNORE_INDEX."""
    x = torch.full((len(lengths), width), PAD)
    y = torch.full((len(lengths), width), IGNORE_INDEX)
    for i, n in enumerate(lengths):
        x[i, :n] = torch.arange(3, 3 + n)
        y[i, :n] = torch.arange(4, 4 + n)
    return x, y


def test_trim_padding_cuts_after_the_last_real_target():
    x, y = right_padded([5, 20, 9], 64)
    tx, ty = data_mod.trim_padding(x, y)
    assert tx.shape == ty.shape == (3, 32)  # 20 rounded up to a multiple of 16
    assert torch.equal(tx, x[:, :32]) and torch.equal(ty, y[:, :32])
    assert data_mod.trim_padding(x, y, multiple=1)[0].shape == (3, 20)
    assert data_mod.trim_padding(*right_padded([60], 64))[0].shape == (1, 64)  # not past T
    full = right_padded([64, 3], 64)
    assert data_mod.trim_padding(*full)[0] is full[0]  # a full row (or pack mode): untouched
    assert data_mod.trim_padding(*right_padded([0, 0], 64), multiple=1)[0].shape == (2, 1)


def test_trimmed_batch_has_the_same_loss_and_gradients():
    from llama_ddp.model.config import preset
    from llama_ddp.model.llama import LlamaForPretraining

    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=64))
    x, y = right_padded([7, 19, 3, 11], 64)
    results = []
    for batch in [(x, y), data_mod.trim_padding(x, y, multiple=1)]:
        model.zero_grad()
        logits = model(batch[0])
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), batch[1].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )
        loss.backward()
        results.append((loss.item(), [p.grad.clone() for p in model.parameters()]))
        assert logits.shape[1] == (64 if len(results) == 1 else 19)
    (full_loss, full_grads), (cut_loss, cut_grads) = results
    assert cut_loss == pytest.approx(full_loss, rel=1e-6)
    for a, b in zip(full_grads, cut_grads):  # summed loss: compare relative to the gradient
        assert (a - b).abs().max() <= 1e-5 * a.abs().max()


def test_loader_trims_pad_batches_of_short_documents(tmp_path, tiny_tokenizer):
    corpus = make_corpus(tmp_path, [SHORT] * 10)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=64)
    sampler = batches_of(len(train), 4)
    batch = next(iter(make_loader(train, sampler, padded=True)))
    x, y = batch.x, batch.y
    assert x.shape == y.shape == (4, 16)  # SHORT is under 16 tokens
    assert (y[:, -1] == IGNORE_INDEX).all() and (y != IGNORE_INDEX).sum() > 0
    assert next(iter(make_loader(train, sampler, trim=False, padded=True))).x.shape == (4, 64)


def test_pack_batches_label_every_position(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=8, packing="pack")
    batch = next(iter(make_loader(train, batches_of(len(train), 4))))
    assert batch.computed is None and batch.targets == 4 * 8
    assert torch.equal(batch.labels, batch.y.flatten())


CPU = torch.device("cpu")


def slow_source(n: int, load_s: float, log: list):
    for i in range(n):
        time.sleep(load_s)  # sampling, collating, planning: host work that releases the GIL
        log.append(i)
        yield [i]


def test_a_step_costs_the_longer_of_loading_and_computing_not_their_sum():
    """Loading takes 0.1 s and a step 0.1 s: with the loader a step ahead, 10 steps take about
    1.1 s (max, plus the first load), not 2 s (their sum); the batches come in order, all of
    them, and the thread never reads more than one step ahead of the loop."""
    n, load_s, compute_s = 10, 0.1, 0.1
    loaded: list[int] = []
    start = time.perf_counter()
    batches = Prefetcher(slow_source(n, load_s, loaded), CPU)
    seen = []
    for micro_batches in batches:
        seen += micro_batches
        time.sleep(compute_s)  # the training step
        assert len(loaded) <= len(seen) + 2  # the batch in the queue and the one being made
    elapsed = time.perf_counter() - start
    batches.close()
    assert seen == list(range(n))
    assert elapsed < 0.75 * (load_s + compute_s) * n


def test_an_error_of_the_loader_is_raised_by_the_loop_in_its_place():
    def broken():
        yield [0]
        raise ValueError("data file broken at line 3")

    batches = Prefetcher(broken(), CPU)
    assert next(batches) == [0]
    with pytest.raises(ValueError, match="line 3"):
        next(batches)
    batches.close()


def test_close_stops_a_thread_that_waits_to_hand_over_a_batch():
    def endless():
        i = 0
        while True:
            yield [i]
            i += 1

    batches = Prefetcher(endless(), CPU)
    assert next(batches) == [0]
    batches.close()
    assert not batches.thread.is_alive()


def test_close_does_not_wait_for_a_loader_that_waits_for_data():
    """A loader waiting for a shard the cache builder has yet to write does not hold up the end
    of the run; the thread stops once its batch is made."""
    shard_written = threading.Event()

    def waiting():
        yield [0]
        assert shard_written.wait(timeout=30)
        yield [1]

    batches = Prefetcher(waiting(), CPU)
    assert next(batches) == [0]
    batches.close()
    assert batches.thread.is_alive()  # still inside the loader
    shard_written.set()
    batches.thread.join(timeout=30)
    assert not batches.thread.is_alive()
