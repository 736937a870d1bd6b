import itertools
import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from llama_ddp import cache as cache_mod
from llama_ddp import data as data_mod
from llama_ddp.corpus import load_splits
from llama_ddp.data import (
    IGNORE_INDEX,
    GlobalBatchSampler,
    PackedDataset,
    PretrainingDataset,
    build_datasets,
    make_loader,
)
from llama_ddp.errors import UserError
from llama_ddp.layout import plan_attention
from llama_ddp.tokenizer import SpecialIds, special_tokens, train_tokenizer

BOT, EOT, PAD = 0, 1, 2
SHORT = "def add(a, b):"
LONG = "The quick brown fox jumps over the lazy dog. " * 20


def make_corpus(tmp_path: Path, texts: list[str], val_fraction: float = 0.2):
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return load_splits(str(path), val_fraction=val_fraction, cache_dir=tmp_path / "cache")


def framed(tok, text: str) -> list[int]:
    return [BOT, *tok.encode(text).ids, EOT]


@pytest.fixture
def texts(tiny_texts):
    return [*tiny_texts[:4], SHORT, LONG] * 3


def build(tmp_path, corpus, tok, **kwargs):
    kwargs.setdefault("seq_length", 16)
    kwargs.setdefault("packing", "pad")
    return build_datasets(corpus, tok, cache_dir=tmp_path / "cache", **kwargs)


def item(x: torch.Tensor, y: torch.Tensor) -> list[int]:
    """The seq_length + 1 tokens an (x, y) pair was cut from, ignored targets shown as PAD."""
    return [*x.tolist(), PAD if y[-1] == IGNORE_INDEX else int(y[-1])]


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


def test_the_roles_frame_and_pad_documents_and_key_the_cache(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    roles = SpecialIds(bot=5, eot=6, pad=6)  # a hub tokenizer's BOS/EOS, padding with the EOS
    train, _ = build(tmp_path, corpus, tiny_tokenizer, special=roles)
    x, y = train[list(corpus.train).index(SHORT)]
    t = [5, *tiny_tokenizer.encode(SHORT).ids, 6]
    assert x.tolist() == t + [6] * (16 - len(t))
    assert y.tolist() == t[1:] + [IGNORE_INDEX] * (17 - len(t))  # padding masked by position
    build(tmp_path, corpus, tiny_tokenizer)  # our [BOT]/[EOT]/[PAD]: another cache
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 2


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
    sampler = GlobalBatchSampler(len(masked), global_batch=4, micro_batch=4, shuffle=False)
    batch = next(iter(make_loader(masked, sampler)))
    assert torch.equal(
        batch.document_ids, torch.stack([masked.document_ids(i)[:-1] for i in range(4)])
    )
    assert torch.equal(batch.y, torch.stack([masked[i][1] for i in range(4)]))
    assert batch.targets == int((batch.y != IGNORE_INDEX).sum()) and batch.real is None
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
        sampler = GlobalBatchSampler(len(train), global_batch=4, micro_batch=4, shuffle=False)
        batch = next(iter(make_loader(train, sampler)))
        assert batch.document_ids is None, (packing, mask)
        # pad: a plan of the real positions; plain causal packing: none (every position)
        assert (batch.plan is None) == (packing == "pack"), (packing, mask)
        width = batch.x.shape[1]  # pad batches are cut after their longest document
        assert torch.equal(batch.x, torch.stack([train[i][0][:width] for i in range(4)]))


def test_literal_special_token_text_is_encoded_as_text(tmp_path, tiny_tokenizer):
    corpus = make_corpus(tmp_path, ["see [EOT] and [PAD] here"] * 4, val_fraction=0.3)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=64)
    tokens = item(*train[0])
    assert (
        tokens[0] == BOT
        and tokens.count(EOT) == 1
        and tokens.count(PAD) == 64 + 1 - tokens.index(EOT) - 1
    )


def test_cache_is_reused_without_tokenizing(tmp_path, tiny_tokenizer, texts, monkeypatch):
    corpus = make_corpus(tmp_path, texts)
    train, val = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    expected = [item(*train[i]) for i in range(len(train))]

    def refuse(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cache_mod, "_encode_chunk", refuse)
    again, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    assert [item(*again[i]) for i in range(len(again))] == expected
    # the key ignores the sequence settings: other windows come from the same arrays
    packed, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=5, packing="pack")
    assert len(packed) > 0
    caches = [
        p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith(("tokens-", ".tokens-"))
    ]
    assert len(caches) == 1 and caches[0].startswith("tokens-")  # no temp folder left


def test_cache_is_rebuilt_for_another_tokenizer(tmp_path, tiny_tokenizer, texts, monkeypatch):
    corpus = make_corpus(tmp_path, texts)
    build(tmp_path, corpus, tiny_tokenizer)
    other = train_tokenizer(texts, vocab_size=300)
    calls = []
    real = cache_mod._encode_chunk
    monkeypatch.setattr(cache_mod, "_encode_chunk", lambda *a: calls.append(1) or real(*a))
    train, _ = build(tmp_path, corpus, other, seq_length=16)
    assert calls
    assert item(*train[0])[:3] == framed(other, list(corpus.train)[0])[:3]
    assert len(list((tmp_path / "cache").glob("tokens-*"))) == 2


def test_cache_layout_is_flat_and_compact(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer)
    folder = next((tmp_path / "cache").glob("tokens-*"))
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["dtype"] == "uint16"
    tokens = np.fromfile(folder / "train.bin", dtype=np.uint16)
    offsets = np.fromfile(folder / "train.idx", dtype=np.int64)
    docs = list(corpus.train)
    assert (
        offsets.tolist() == np.cumsum([0] + [len(framed(tiny_tokenizer, d)) for d in docs]).tolist()
    )
    assert tokens.tolist() == [t for d in docs for t in framed(tiny_tokenizer, d)]


def test_worker_processes_build_the_same_cache(tmp_path, tiny_tokenizer, texts, monkeypatch):
    monkeypatch.setattr(cache_mod, "_CHUNK_DOCS", 4)  # several chunks, so order matters
    corpus = make_corpus(tmp_path, texts)
    build(tmp_path / "a", corpus, tiny_tokenizer)
    build(tmp_path / "b", corpus, tiny_tokenizer, num_proc=2)
    a = next((tmp_path / "a" / "cache").glob("tokens-*"))
    b = next((tmp_path / "b" / "cache").glob("tokens-*"))
    for name in ("train.bin", "train.idx", "validation.bin", "validation.idx", "meta.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes()


def test_followers_wait_for_the_main_process(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    barriers = []
    with pytest.raises(UserError, match="missing after the main process built it"):
        build(tmp_path, corpus, tiny_tokenizer, is_main=False, barrier=lambda: barriers.append(1))
    build(tmp_path, corpus, tiny_tokenizer, barrier=lambda: barriers.append(1))
    train, _ = build(
        tmp_path, corpus, tiny_tokenizer, is_main=False, barrier=lambda: barriers.append(1)
    )
    assert barriers == [1, 1, 1] and len(train) > 0


def test_datasets_pickle_without_their_tokens(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    for packing, cls in (("pad", PretrainingDataset), ("pack", PackedDataset)):
        train, _ = build(tmp_path, corpus, tiny_tokenizer, packing=packing)
        assert isinstance(train, cls)
        before = item(*train[1])
        blob = pickle.dumps(train)
        assert len(blob) < 1000
        assert item(*pickle.loads(blob)[1]) == before
        with pytest.raises(IndexError):
            train[len(train)]


def test_user_errors(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    with pytest.raises(ValueError, match="packing must be"):  # users' flags: TrainConfig
        build(tmp_path, corpus, tiny_tokenizer, packing="stuff")
    with pytest.raises(UserError, match="fewer than one sequence of 4097"):
        build(tmp_path, corpus, tiny_tokenizer, seq_length=4096, packing="pack")
    with pytest.raises(UserError, match="no non-empty documents"):
        build(
            tmp_path, make_corpus(tmp_path / "e", ["", "", "x"], val_fraction=0.5), tiny_tokenizer
        )


def test_loader_stacks_micro_batches(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=16)
    sampler = GlobalBatchSampler(len(train), global_batch=4, micro_batch=2)
    batches = list(make_loader(train, sampler))
    assert len(batches) == 2 * (len(train) // 4)
    batch = batches[0]
    assert batch.x.shape == batch.y.shape == (2, 16) and batch.x.dtype == torch.int64
    first = next(iter(sampler))
    assert torch.equal(batch.x, torch.stack([train[i][0] for i in first]))
    # pad mode: the real-target mask, the labels of the model's rows, their count
    assert torch.equal(batch.real, batch.y != IGNORE_INDEX)
    assert torch.equal(batch.labels, batch.y[batch.real]) and batch.targets == len(batch.labels)


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
    from llama_ddp.model import LlamaForPretraining
    from llama_ddp.model_config import preset

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
    sampler = GlobalBatchSampler(len(train), global_batch=4, micro_batch=4)
    batch = next(iter(make_loader(train, sampler)))
    x, y = batch.x, batch.y
    assert x.shape == y.shape == (4, 16)  # SHORT is under 16 tokens
    assert (y[:, -1] == IGNORE_INDEX).all() and (y != IGNORE_INDEX).sum() > 0
    assert next(iter(make_loader(train, sampler, trim=False))).x.shape == (4, 64)


def test_pack_batches_label_every_position(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, _ = build(tmp_path, corpus, tiny_tokenizer, seq_length=8, packing="pack")
    batch = next(
        iter(make_loader(train, GlobalBatchSampler(len(train), global_batch=4, micro_batch=4)))
    )
    assert batch.real is None and batch.targets == 4 * 8
    assert torch.equal(batch.labels, batch.y.flatten())


# --- GlobalBatchSampler ---------------------------------------------------------------------------


def micro_batches_by_step(num_samples, world_size, *, global_batch, micro_batch, seed=0, epoch=0):
    """{step: [indices of all ranks' micro-batches]} for one epoch."""
    steps: dict[int, list[int]] = {}
    for rank in range(world_size):
        s = GlobalBatchSampler(
            num_samples,
            global_batch=global_batch,
            micro_batch=micro_batch,
            rank=rank,
            world_size=world_size,
            seed=seed,
        )
        s.seek(epoch, 0)
        assert len(s) == s.steps_per_epoch * s.accum_steps
        for k, mb in enumerate(s):
            assert len(mb) == micro_batch
            steps.setdefault(k // s.accum_steps, []).extend(mb)
    return steps


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_world_size_trains_on_the_same_global_batches(world_size):
    reference = micro_batches_by_step(103, 1, global_batch=8, micro_batch=8)
    steps = micro_batches_by_step(103, world_size, global_batch=8, micro_batch=2)
    assert len(steps) == len(reference) == 103 // 8
    for g, indices in steps.items():
        assert sorted(indices) == sorted(reference[g])


def test_two_ranks_cover_the_epoch_once():
    n, b = 50, 8
    steps = micro_batches_by_step(n, 2, global_batch=b, micro_batch=2)
    seen = [i for g in sorted(steps) for i in steps[g]]
    assert len(seen) == len(set(seen)) == (n // b) * b
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert set(seen) == set(order[: (n // b) * b].tolist())


def test_epochs_reshuffle_and_unshuffled_is_in_order():
    first = micro_batches_by_step(40, 1, global_batch=8, micro_batch=4, epoch=0)
    second = micro_batches_by_step(40, 1, global_batch=8, micro_batch=4, epoch=1)
    assert first != second and sorted(sum(first.values(), [])) == sorted(sum(second.values(), []))
    plain = GlobalBatchSampler(40, global_batch=8, micro_batch=4, shuffle=False)
    assert sum(list(plain), []) == list(range(40))


def test_seeking_to_a_step_equals_continuing():
    kwargs = dict(global_batch=8, micro_batch=2, rank=1, world_size=2, seed=3)
    s = GlobalBatchSampler(100, **kwargs)
    s.seek(2, 0)
    whole = list(s)
    assert len(whole) == s.steps_per_epoch * 2  # two micro-batches per step on each rank
    s.seek(2, 3)  # three optimizer steps in: nothing before them is read
    assert len(s) == len(whole) - 3 * s.accum_steps
    assert list(s) == whole[3 * s.accum_steps :]
    with pytest.raises(ValueError, match="outside an epoch of 12 steps"):
        s.seek(0, 12)


def test_train_data_batches_cycle_epochs_from_any_step(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    train, val = build(tmp_path, corpus, tiny_tokenizer, seq_length=16, packing="pack")
    sampler = GlobalBatchSampler(len(train), global_batch=4, micro_batch=2, seed=5)
    special = special_tokens(tiny_tokenizer)
    loader = make_loader(train, sampler)
    data = data_mod.TrainData(
        tiny_tokenizer, tmp_path, special, "corpus", train, val, sampler, loader
    )
    epoch = sampler.steps_per_epoch
    run = [[b.x for b in step] for step in itertools.islice(data.batches(0), epoch + 3)]
    resumed = [[b.x for b in step] for step in itertools.islice(data.batches(epoch - 1), 4)]
    for a, b in zip(run[epoch - 1 :], resumed):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(run[0][0], run[epoch][0])  # the next epoch reshuffles


def test_sampler_shape_errors():
    with pytest.raises(
        UserError, match=r"--batch-size 10 is not a multiple of --micro-batch-size 2 x 4 "
    ):
        GlobalBatchSampler(100, global_batch=10, micro_batch=2, world_size=4)
    with pytest.raises(
        UserError, match="dataset has 5 sequences, fewer than one global batch of 8"
    ):
        GlobalBatchSampler(5, global_batch=8, micro_batch=4)
    with pytest.raises(UserError, match="outside world size"):
        GlobalBatchSampler(100, global_batch=8, micro_batch=4, rank=2, world_size=2)


def test_a_full_cache_disk_is_one_line_and_leaves_no_half_built_cache(
    tmp_path, tiny_tokenizer, texts, monkeypatch
):
    import errno

    from llama_ddp.errors import WriteFailed

    corpus = make_corpus(tmp_path, texts)

    def full(chunks, stem):
        Path(f"{stem}.bin").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device", f"{stem}.bin")

    monkeypatch.setattr(cache_mod, "_write_split", full)
    with pytest.raises(WriteFailed, match=r"cannot write token cache .*: No space left on device"):
        build(tmp_path, corpus, tiny_tokenizer)
    assert not [p for p in (tmp_path / "cache").iterdir() if "tokens-" in p.name]
