"""mixture.py: which source, shard and item each sequence of each global batch is."""

import dataclasses
import itertools
import json
import pickle
import random
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from llama_ddp.data.mixture import MixtureSampler, Plan, micro_batch_size
from llama_ddp.data.pipeline import PackedDataset, PretrainingDataset
from llama_ddp.data.tokenizer import train_tokenizer
from llama_ddp.data.tokenizer_files import save_tokenizer
from llama_ddp.distributed import runtime as D
from llama_ddp.errors import UserError
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.run import run_data
from tests.helpers.runs import WORDS
from tests.helpers.token_data import build, item, make_corpus


def test_plan_is_the_sequential_rule_at_any_offset_and_within_an_item_of_the_weights():
    for weights in ([0.7, 0.3], [1, 1, 1], [0.01, 0.99], [3, 2, 5, 0.1]):
        plan, counts, order = Plan(weights), [0] * len(weights), []
        for _ in range(2000):  # the rule, one slot after another
            key = [((2 * c + 1) / w, s) for s, (c, w) in enumerate(zip(counts, plan.weights))]
            s = min(key)[1]
            order.append(s)
            counts[s] += 1
        for n in (0, 1, 7, 100, 1999):
            assert plan.counts(n) == [order[:n].count(s) for s in range(len(weights))]
        assert [s for s, _ in plan.slots(37, 500)] == order[37:537]
        for n in range(1, 2000):
            for s, w in enumerate(plan.weights):
                assert abs(order[:n].count(s) - n * w) < 1


def write_source(path: Path, docs: int, words: tuple[int, int], seed: int) -> Path:
    rng = random.Random(seed)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*words))) for _ in range(docs)]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two sources of unlike documents (short and long ones), a tokenizer, a cache folder."""
    root = tmp_path_factory.mktemp("mixture")
    short = write_source(root / "short.jsonl", 800, (3, 20), seed=1)
    long = write_source(root / "long.jsonl", 200, (60, 160), seed=2)
    docs = [json.loads(line)["text"] for p in (short, long) for line in p.read_text().splitlines()]
    save_tokenizer(train_tokenizer(docs, 320), root / "tokenizer.json")
    return root


def config(root: Path, *extra: str, cache: Path | None = None):
    args = [
        "--preset", "tiny", "--dataset", str(root / "short.jsonl"), "--dataset",
        str(root / "long.jsonl"), "--tokenizer", str(root / "tokenizer.json"),
        "--seq-length", "32", "--batch-size", "8", "--max-steps", "300",
        "--cache-dir", str(cache or root / "cache"), *extra,
    ]  # fmt: skip
    return parse_train_args(args)


def data_of(cfg):
    data = run_data(cfg, D.setup("single", "cpu"))
    if data.builder is not None:
        data.builder.process.join()  # the rest of the cache: tests read all of it
        data.builder.check()
    return data


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_realized_token_shares_match_the_weights(sources, packing):
    data = data_of(config(sources, "--dataset-weights", "0.7,0.3", "--packing", packing))
    totals = {"short": 0, "long": 0}
    for step in range(1, 301):
        for name, n in data.source_targets(step).items():
            totals[name] += n
        if step in (50, 300):
            share = totals["short"] / sum(totals.values())
            assert abs(share - 0.7) < 0.02, (step, share)
    # The counts are those the loss sees: the targets of the step's batches, on every rank.
    batches = next(data.batches(0))
    assert sum(data.source_targets(1).values()) == sum(b.targets for b in batches)


def test_every_world_size_trains_on_the_same_global_batches(sources):
    data = data_of(config(sources, "--dataset-weights", "0.5,0.5"))
    plan, streams = data.sampler.plan, data.sampler.streams
    reference = [data.sampler.global_keys(g) for g in range(12)]
    reseeded = data_of(config(sources, "--dataset-weights", "0.5,0.5", "--seed", "1"))
    assert [reseeded.sampler.global_keys(g) for g in range(12)] != reference  # the seed's order
    for world, micro in ((2, 2), (4, 1), (4, 2)):
        ranks = [
            MixtureSampler(
                plan, streams, global_batch=8, micro_batch=8 // world, rank=r, world_size=world
            )
            for r in range(world)
        ]
        for sampler in ranks:  # as --micro-batch-size auto sets it, before any batch is read
            sampler.set_micro_batch(micro)
        with pytest.raises(UserError, match="is not a multiple of --micro-batch-size 3"):
            ranks[0].set_micro_batch(3)
        accum = ranks[0].accum_steps
        assert accum == 8 // (micro * world)
        for sampler in ranks:
            sampler.seek(3)  # resumed at step 3: index arithmetic, nothing before it is read
        its = [iter(s) for s in ranks]
        for g in range(3, 12):
            slices = [[next(it) for _ in range(accum)] for it in its]
            together = [k for j in range(accum) for r in range(world) for k in slices[r][j]]
            assert together == reference[g], (world, micro, g)


def test_batches_do_not_depend_on_when_the_shards_were_built(sources, tmp_path, monkeypatch):
    """A run that starts on the first shards, while the others appear one by one, reads the
    batches of a run over the finished cache."""
    monkeypatch.setenv("LLAMA_DDP_SHARDS", "first=1000,largest=2000,whole=0")  # as large ones
    complete = data_of(config(sources, cache=tmp_path / "complete"))
    folders = sorted((tmp_path / "complete").glob("tokens-*"))
    assert all(len(list(f.glob("train-*.idx"))) > 5 for f in folders)
    for folder in folders:  # a cache being built: each source's first shard and validation
        partial = tmp_path / "partial" / folder.name
        partial.mkdir(parents=True)
        for name in ("train-00000.bin", "train-00000.idx", "validation.json"):
            shutil.copy(folder / name, partial / name)
        for path in folder.glob("validation-*"):
            shutil.copy(path, partial / path.name)

    def build_the_rest():  # as the builder does: one shard after another, the .idx last
        for k in itertools.count(1):
            built = [f for f in folders if (f / f"train-{k:05d}.idx").exists()]
            if not built:
                break
            for folder in built:
                for kind in ("bin", "idx"):
                    name = f"train-{k:05d}.{kind}"
                    tmp = tmp_path / "partial" / folder.name / f".{name}.tmp"
                    shutil.copy(folder / name, tmp)
                    tmp.rename(tmp.with_name(name))
            time.sleep(0.05)
        for folder in folders:  # the totals come last, once every shard is there
            shutil.copy(folder / "train.json", tmp_path / "partial" / folder.name / "train.json")

    building = config(sources, cache=tmp_path / "partial")
    follower = D.Runtime("single", torch.device("cpu"), local_rank=1)  # another builds
    data = run_data(building, follower)
    assert data.builder is None  # nothing for this process to build: it reads as shards come
    assert data.sampler.steps_per_epoch is None
    ours, theirs = data.batches(0), complete.batches(0)
    for _ in range(2):  # training starts on the first shards...
        a, b = next(ours), next(theirs)
        assert all(torch.equal(x.x, y.x) and torch.equal(x.y, y.y) for x, y in zip(a, b))
    assert [len(d.split.shards) for d in data.train.sources] == [1, 1]
    copier = threading.Thread(target=build_the_rest)  # ...and waits for the next ones
    copier.start()
    try:
        for step in range(3, 500):  # into the sources' second epochs
            a, b = next(ours), next(theirs)
            assert all(torch.equal(x.x, y.x) and torch.equal(x.y, y.y) for x, y in zip(a, b))
            if complete.epoch(step) == 1:
                break
    finally:
        copier.join()
    assert data.epoch(step) == 1 and step > 100


def test_a_source_that_runs_out_repeats_reshuffled_with_a_note(sources, capsys):
    data = data_of(config(sources, "--dataset-weights", "0.1,0.9"))
    capsys.readouterr()
    long = data.sampler.streams[1]
    size = long.size()
    first = [long.locate(c) for c in range(size)]
    second = [long.locate(c) for c in range(size, 2 * size)]
    assert {e for e, *_ in first} == {0} and {e for e, *_ in second} == {1}
    assert sorted(k for _, *k in first) == sorted(k for _, *k in second)  # the same items...
    assert [k for _, *k in first] != [k for _, *k in second]  # ...in another order
    plan = data.sampler.plan
    starts = [
        next(n for n in itertools.count() if plan.counts(n + 1)[1] > e * size) for e in (1, 2)
    ]
    for g in range(starts[1] // 8 + 3):
        data.sampler.global_keys(g)
    notes = [line for line in capsys.readouterr().out.splitlines() if "ran out" in line]
    assert notes == [
        f"note: source 'long' ran out: its epoch {e} begins (reshuffled) at step {n // 8 + 1}"
        for e, n in zip((1, 2), starts)
    ]  # once per epoch of the source, at the step that reads its first item


def test_a_small_source_is_tokenized_first_and_shuffled_whole(sources, tmp_path, monkeypatch):
    """Below Sharding.whole bytes a source's cache is complete before training and each epoch is
    one permutation of all its items (a corpus sorted by topic still trains on a mix from step 1);
    a larger one reads its shards in order in its first epoch, with or without --max-steps (a
    run without it waits for the whole cache, yet draws the same batches)."""
    monkeypatch.setenv("LLAMA_DDP_SHARDS", "first=1000,largest=2000")
    whole = data_of(config(sources, cache=tmp_path / "c"))
    monkeypatch.setenv("LLAMA_DDP_SHARDS", "first=1000,largest=2000,whole=0")
    streamed = data_of(config(sources, cache=tmp_path / "c"))  # the same cache
    bounded = config(sources, cache=tmp_path / "c")
    unbounded = data_of(
        dataclasses.replace(bounded, schedule=dataclasses.replace(bounded.schedule, max_steps=None))
    )
    waited = unbounded.sampler
    assert waited.steps_per_epoch and not any(s.whole for s in waited.streams)
    assert all(waited.global_keys(g) == streamed.sampler.global_keys(g) for g in range(9))
    for data, in_order in ((whole, False), (streamed, True)):
        stream = data.sampler.streams[1]
        n = stream.size()
        keys = [stream.locate(c) for c in range(2 * n)]
        items = {(k, i) for _, k, i in keys[:n]}
        assert len(items) == n and {e for e, *_ in keys[:n]} == {0}  # each item once an epoch
        assert {(k, i) for _, k, i in keys[n:]} == items and {e for e, *_ in keys[n:]} == {1}
        shards = [k for _, k, _ in keys[:n]]
        assert (shards == sorted(shards)) == in_order and len(set(shards)) > 5
    assert whole.sampler.streams[1].whole and not streamed.sampler.streams[1].whole


def test_datasets_pickle_without_their_tokens(tmp_path, tiny_tokenizer, texts):
    corpus = make_corpus(tmp_path, texts)
    for packing, cls in (("pad", PretrainingDataset), ("pack", PackedDataset)):
        train, _ = build(tmp_path, corpus, tiny_tokenizer, packing=packing)
        assert isinstance(train.part(0), cls)
        before = item(*train[1])
        blob = pickle.dumps(train)
        assert len(blob) < 1000
        assert item(*pickle.loads(blob)[1]) == before
        with pytest.raises(IndexError):
            train[len(train)]


def test_a_batch_that_does_not_split_over_the_processes_names_no_micro_batch():
    """Issue 52, item 12: no --micro-batch-size was given, so the line names none."""
    with pytest.raises(UserError) as err:
        micro_batch_size(7, None, 2)
    assert str(err.value) == (
        "--batch-size 7 does not split over 2 processes (choose a global batch that is a "
        "multiple of 2)"
    )
    with pytest.raises(UserError, match="is not a multiple of --micro-batch-size 3 x 2"):
        micro_batch_size(8, 3, 2)
