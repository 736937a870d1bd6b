"""The evaluation component: which tokens the validation loss scores, and with what context."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from llama_ddp.data import pipeline as data_mod
from llama_ddp.data.pipeline import IGNORE_INDEX
from llama_ddp.data.tokenizer_files import special_tokens
from llama_ddp.distributed import runtime as D
from llama_ddp.eval.scoring import TaskEvaluator
from llama_ddp.eval.tasks import Task, multiple_choice
from llama_ddp.eval.windows import document_windows, windows
from llama_ddp.model import llama as llama_module
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from llama_ddp.model.loss import batch_loss_sum
from llama_ddp.precision import Precision
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.run import build_trainer, run_data
from llama_ddp.train.validation import (
    Evaluator,
    SplitTokens,
    budget_windows,
    held_out,
    validation_batches,
)
from tests.helpers.runs import tiny_args
from tests.helpers.token_data import BOT, EOT, LONG, SMALL, build, make_corpus


def test_validation_is_each_document_alone_in_every_packing_mode_and_world_size(
    train_env, tmp_path
):
    """The validation loss scores every held-out token with its own document's earlier context up
    to --seq-length (strided windows beyond): the same value in pad and pack mode, with or
    without document masking, and summed over 2 or 3 ranks' shares; and the value of scoring
    each window alone, one forward each."""
    cache = ["--cache-dir", str(train_env["root"] / "cache"), "--seq-length", "32"]
    values = []
    for packing in (["pad"], ["pack"], ["pack", "--no-document-mask"]):
        args = tiny_args(train_env, tmp_path, "--packing", *packing, *cache, "--batch-size", "12")
        cfg = parse_train_args(args)
        trainer = build_trainer(cfg, D.setup("single", "cpu"))
        values.append(trainer.evaluator.loss())
    model, precision = trainer.model, trainer.precision
    for world_size in (2, 3):
        total, count = 0.0, 0
        for rank in range(world_size):
            rt = D.Runtime("single", torch.device("cpu"), rank=rank, world_size=world_size)
            with torch.no_grad():
                for b in validation_batches(run_data(cfg, rt), rt):
                    total += batch_loss_sum(model, b, precision).item()
                    count += b.targets
        values.append(total / count)
    split = SplitTokens(trainer.data.validation[trainer.data.names[0]].split)
    total, count = 0.0, 0
    with torch.no_grad():
        for a, b in zip(split.offsets[:-1].tolist(), split.offsets[1:].tolist()):
            doc = torch.as_tensor(split[a:b].astype("int64"))
            for start, end, first in windows(b - a, 32):
                logits = model(doc[None, start:end])[0, first - start :]
                total += F.cross_entropy(logits, doc[first + 1 : end + 1], reduction="sum").item()
                count += end - first
    assert count == split.num_tokens - split.num_docs
    assert max(b - a for a, b in zip(split.offsets[:-1], split.offsets[1:])) > 33  # strided too
    assert values == pytest.approx([total / count] * 5, rel=1e-6)


def test_bits_per_byte_is_the_summed_loss_in_bits_over_the_held_out_texts_bytes(
    train_env, tmp_path
):
    """val_bpb = summed loss / ln 2 / the UTF-8 bytes of the held-out documents (each decoded
    from its tokens, [BOT] and [EOT] apart), counted by hand here."""
    cache = ["--cache-dir", str(train_env["root"] / "cache"), "--seq-length", "32"]
    args = tiny_args(train_env, tmp_path, *cache, "--batch-size", "12", "--eval-tokens", "all")
    trainer = build_trainer(parse_train_args(args), D.setup("single", "cpu"))
    loss, bpb = trainer.evaluator.scores()
    scored = held_out(trainer.data)
    targets = int((scored.windows[:, 1] - scored.windows[:, 2]).sum())
    split, tok = scored.tokens, trainer.data.tokenizer
    texts = [
        tok.decode(split[slice(a + 1, b - 1)].tolist())  # [BOT] doc [EOT]: the doc's tokens
        for a, b in zip(split.offsets[:-1].tolist(), split.offsets[1:].tolist())
    ]
    assert all(split[slice(a, a + 1)][0] == BOT for a in split.offsets[:-1].tolist())
    num_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert num_bytes > 1000
    assert bpb == pytest.approx(loss * targets / np.log(2) / num_bytes, rel=1e-9)
    # what a time budget's end reserve counts for `all` (Budget.held_out): the split's tokens
    assert trainer.evaluator.held_out_targets() == split.num_tokens >= targets
    record = trainer.evaluator.record(0)
    assert record["val_bpb"] == pytest.approx(bpb, rel=1e-12)


def test_budget_windows_are_the_fewest_of_a_fixed_sample_in_document_order():
    """--eval-tokens N: the fewest windows of one fixed random order that score N targets,
    given back in document order; all of them when N covers them (or with `all`)."""
    rng = np.random.default_rng(5)
    lengths = rng.integers(2, 200, size=300)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    every = document_windows(offsets, 32)
    scored = every[:, 1] - every[:, 2]
    total = int(scored.sum())
    for tokens in (1, 100, 1000, total // 2, total - 1):
        chosen = budget_windows(every, tokens)
        rows = [every.tolist().index(w) for w in chosen.tolist()]
        assert rows == sorted(set(rows))  # distinct, in document order
        counts = chosen[:, 1] - chosen[:, 2]
        assert counts.sum() >= tokens and counts.sum() - counts.max() < tokens
        assert np.array_equal(budget_windows(every, tokens), chosen)  # the same every time
    assert np.array_equal(budget_windows(every, total), every)
    assert np.array_equal(budget_windows(every, None), every)
    # A larger budget adds windows to a smaller one's: the sample is one order's prefix.
    small, large = budget_windows(every, 500).tolist(), budget_windows(every, 5000).tolist()
    assert all(w in large for w in small)
    # Not the first documents: a sample from all over the held-out side.
    assert budget_windows(every, 1000)[-1, 0] > offsets[len(offsets) // 2]


def test_a_budgeted_evaluation_scores_the_same_windows_at_every_world_size(train_env, tmp_path):
    """With --eval-tokens 200 each evaluation scores the same sampled windows: the mean over
    every rank's share equals one process's, and the loss of those windows scored one by one;
    its lm_head sees only the positions it scores (the windows' context gets no logits)."""
    cache = ["--cache-dir", str(train_env["root"] / "cache"), "--seq-length", "32"]
    args = tiny_args(train_env, tmp_path, *cache, "--batch-size", "12", "--eval-tokens", "200")
    cfg = parse_train_args(args)
    trainer = build_trainer(cfg, D.setup("single", "cpu"))
    model, precision = trainer.model, trainer.precision
    rows_seen, chunked = [], llama_module.linear_token_loss_sum

    def lm_head_loss(hidden, *args, **kwargs):  # the lm_head's rows: the scored positions alone
        rows_seen.append(hidden.shape[0])
        return chunked(hidden, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(llama_module, "linear_token_loss_sum", lm_head_loss)
        loss = trainer.evaluator.loss()
    scored = held_out(trainer.data, tokens=200)
    targets = scored.windows[:, 1] - scored.windows[:, 2]
    assert 200 <= targets.sum() < 200 + targets.max()  # a sample, not all of them
    assert len(scored.windows) < len(held_out(trainer.data).windows)
    assert sum(rows_seen) == targets.sum()
    ranks = []
    for world_size in (2, 3):
        total, count = 0.0, 0
        for rank in range(world_size):
            rt = D.Runtime("single", torch.device("cpu"), rank=rank, world_size=world_size)
            with torch.no_grad():
                for b in validation_batches(run_data(cfg, rt), rt, scored):
                    total += batch_loss_sum(model, b, precision).item()
                    count += b.targets
        ranks.append(total / count)
    total = 0.0
    with torch.no_grad():
        for start, end, first in scored.windows.tolist():
            doc = torch.as_tensor(scored.tokens[start : end + 1].astype("int64"))
            logits = model(doc[None, :-1])[0, first - start :]
            total += F.cross_entropy(logits, doc[first - start + 1 :], reduction="sum").item()
    assert [loss, *ranks] == pytest.approx([total / targets.sum()] * 3, rel=1e-6)


class NoValidation:
    """A run's data without a validation split."""

    names: list[str] = []

    def weights(self):
        return []


def test_an_evaluation_records_the_tasks_scores_and_their_cost(tiny_tokenizer):
    examples = [
        multiple_choice("the cat", ["runs", "jumps over"], 1),
        multiple_choice("def f", ["(x):", "class"], 0),
    ]
    tasks = TaskEvaluator([Task("t", examples)], tiny_tokenizer, 0)
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=400))
    cpu = torch.device("cpu")
    rt, precision = D.Runtime("single", cpu), Precision(torch.bfloat16, cpu)
    plain = Evaluator(NoValidation(), model, precision, rt, every=5, tokens=2)
    assert plain.record(5) is None  # nothing to score
    calls = []

    def scored(*args):
        calls.append(args)
        return tasks(*args)

    evaluator = Evaluator(NoValidation(), model, precision, rt, every=5, tokens=2, tasks=scored)
    record = evaluator.record(5)
    assert record.keys() == {"step", "tasks", "tasks_s"} and record["step"] == 5
    assert calls == [(model, rt, precision)]  # the run's model, ranks and precision
    assert record["tasks"] == tasks(model, rt, precision)
    assert record["tasks"]["t"]["n"] == 2 and record["tasks_s"] >= 0
    assert model.training  # back to training after scoring


def validation_data(tmp_path, tok, texts, packing, world_size, rank, batch=6):
    """TrainData of one source whose held-out side is in several shards (documents never cross
    them), and that side as one token stream."""
    from llama_ddp.data.sources import Source
    from llama_ddp.train.validation import SplitTokens

    corpus = make_corpus(tmp_path, [LONG, *texts], val_fraction=0.5)  # LONG held out
    train, val = build(tmp_path, corpus, tok, seq_length=16, packing=packing, sharding=SMALL)
    micro = batch // world_size // 2 or 1  # two micro-batches per rank where they divide
    sampler = SimpleNamespace(global_batch=batch, micro_batch=micro)  # its batch shape only
    data = data_mod.TrainData(
        tok, tmp_path, special_tokens(tok), [Source("docs.jsonl", name="c")], ["f"], train,
        {"c": val}, sampler, None, packing, 16, True,
    )  # fmt: skip
    return data, SplitTokens(val.split)


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_validation_scores_every_held_out_token_once_in_windows_of_its_document(
    tmp_path, tiny_tokenizer, texts, world_size
):
    """Every target of every validation document, once, in either packing mode and at every world
    size: each document scored alone, a row as long as its tokens (never longer than
    seq_length), a target with all of its document's earlier tokens up to 16, and after the
    first 16 with at least 8 (the window carries them as unscored context). Every rank yields as
    many batches, the last incomplete one too."""
    from llama_ddp.distributed.runtime import Runtime
    from llama_ddp.train.validation import validation_batches

    scored, counts = {}, []
    for packing in ("pad", "pack"):
        for rank in range(world_size):
            data, split = validation_data(
                tmp_path, tiny_tokenizer, texts, packing, world_size, rank
            )
            rt = Runtime("single", torch.device("cpu"), rank=rank, world_size=world_size)
            batches = list(validation_batches(data, rt))
            counts.append(len(batches))
            for b in batches:
                assert b.x.shape[1] <= 16 and b.document_ids is not None
                for row in range(b.x.shape[0]):
                    n = int(b.computed[row].sum())
                    assert b.computed[row, :n].all() and not b.computed[row, n:].any()  # a prefix
                    for col in (b.y[row] != IGNORE_INDEX).nonzero().flatten().tolist():
                        context = b.x[row, : col + 1].tolist()
                        key = (packing, tuple(context), int(b.y[row, col]))
                        scored[key] = scored.get(key, 0) + 1
    assert len(set(counts)) == 1  # every rank, every packing mode: as many batches
    assert len(split.shards) > 1
    offsets = split.offsets.tolist()
    tokens = [t for shard in split.shards for t in shard.tokens.tolist()]
    expected = {}
    for a, b in zip(offsets[:-1], offsets[1:]):
        doc = tokens[a:b]
        assert doc[0] == BOT and doc[-1] == EOT
        for i in range(1, len(doc)):  # target doc[i], from the window's view of its context
            start = 0 if i <= 16 else max(0, min(16 + -(-(i - 16) // 8) * 8, len(doc) - 1) - 16)
            assert i - start >= min(i, 8)
            for packing in ("pad", "pack"):
                key = (packing, tuple(doc[start:i]), doc[i])
                expected[key] = expected.get(key, 0) + 1
    assert scored == expected
    assert sum(expected.values()) == 2 * (split.num_tokens - split.num_docs)
    assert max(b - a for a, b in zip(offsets[:-1], offsets[1:])) > 100  # strided windows too
