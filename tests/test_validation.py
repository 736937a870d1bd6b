"""validation.py: what an evaluation records, with and without --eval-tasks."""

import torch

from llama_ddp import distributed as D
from llama_ddp.evaluate import TaskEvaluator
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import preset
from llama_ddp.precision import Precision
from llama_ddp.tasks import Task, multiple_choice
from llama_ddp.validation import Evaluator


class NoValidation:
    """A run's data without a validation split."""

    def validation_batches(self, rt, batches):
        return iter(())


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
