"""The evaluation component: which tokens the validation loss scores, and with what context."""

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_args

from llama_ddp import distributed as D
from llama_ddp.cli import parse_train_args
from llama_ddp.data import build_data
from llama_ddp.evaluate import TaskEvaluator
from llama_ddp.loss import batch_loss_sum
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import preset
from llama_ddp.precision import Precision
from llama_ddp.run import build_trainer
from llama_ddp.tasks import Task, multiple_choice
from llama_ddp.validation import Evaluator, SplitTokens, validation_batches
from llama_ddp.windows import windows


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
                for b in validation_batches(build_data(cfg, rt), rt):
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


def test_eval_batches_scores_only_the_first_global_batches(train_env, tmp_path):
    """--eval-batches N: the first N global batches of --batch-size windows, in document order
    (each rank its share of each), and no more; by default all of them."""
    cache = ["--cache-dir", str(train_env["root"] / "cache"), "--seq-length", "32"]
    cfg = parse_train_args(tiny_args(train_env, tmp_path, *cache, "--batch-size", "12"))
    rt = D.Runtime("single", torch.device("cpu"), rank=0, world_size=1)
    data = build_data(cfg, rt)
    every = list(validation_batches(data, rt))
    assert len(every) > 2
    first = list(validation_batches(data, rt, 2))
    accum = data.sampler.accum_steps
    assert len(first) == 2 * accum
    assert all(torch.equal(a.x, b.x) for a, b in zip(first, every))


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
    plain = Evaluator(NoValidation(), model, precision, rt, every=5, batches=2)
    assert plain.record(5) is None  # nothing to score
    calls = []

    def scored(*args):
        calls.append(args)
        return tasks(*args)

    evaluator = Evaluator(NoValidation(), model, precision, rt, every=5, batches=2, tasks=scored)
    record = evaluator.record(5)
    assert record.keys() == {"step", "tasks", "tasks_s"} and record["step"] == 5
    assert calls == [(model, rt, precision)]  # the run's model, ranks and precision
    assert record["tasks"] == tasks(model, rt, precision)
    assert record["tasks"]["t"]["n"] == 2 and record["tasks_s"] >= 0
    assert model.training  # back to training after scoring
