"""scoring.py: the harness's scoring rules, batching, sharding, tasks in the loop. The command
(``python -m llama_ddp.evaluate``): tests/test_evaluate.py."""

import json
import math
import random
from pathlib import Path

import pytest
import torch

from llama_ddp.data.tokenizer import text_encoder
from llama_ddp.data.tokenizer_files import special_ids
from llama_ddp.distributed import runtime as D
from llama_ddp.eval.scoring import accuracy, encode_requests, loglikelihoods
from llama_ddp.eval.tasks import Example, multiple_choice
from llama_ddp.model.config import preset
from llama_ddp.model.llama import LlamaForPretraining
from tests.helpers.runs import WORDS, tiny_args, train_here


def test_requests_split_as_the_harness_encode_pair(tiny_tokenizer):
    bot = special_ids(tiny_tokenizer).bot
    encode = text_encoder(tiny_tokenizer).encode
    pairs = [
        ("def add(a, b):\n   ", " return a + b"),  # trailing whitespace moves onto the answer
        ("The quick brown fo", "x jumps"),  # a word split across the boundary
        ("", "for i in range(10):"),  # no context: BOT alone
    ]
    requests = encode_requests(tiny_tokenizer, bot, pairs)
    for (context, continuation), (ctx, cont) in zip(pairs, requests):
        assert ctx == [bot, *encode(context.rstrip(), add_special_tokens=False).ids]
        whole = encode(context + continuation, add_special_tokens=False).ids
        assert cont == whole[len(ctx) - 1 :]  # the whole's tokens after the context's count
    assert requests[2][0] == [bot]
    # "def add(a, b):" is the context; "\n    return a + b" is scored
    assert tiny_tokenizer.decode(requests[0][1]) == "\n    return a + b"


def reference_loglikelihood(model, ctx: list[int], cont: list[int]) -> float:
    """One request alone, the harness's way: left-truncated to the context + 1, one forward."""
    whole = (ctx + cont)[-(model.config.max_position_embeddings + 1) :]
    with torch.no_grad():
        logprobs = model(torch.tensor([whole[:-1]])).log_softmax(-1)[0]
    n = len(cont)
    return logprobs[-n:].gather(1, torch.tensor(whole[-n:])[:, None]).sum().item()


def random_requests(count: int, vocab: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [
        (
            [0] + [rng.randrange(3, vocab) for _ in range(rng.randint(0, 40))],
            [rng.randrange(3, vocab) for _ in range(rng.randint(1, 6))],
        )
        for _ in range(count)
    ]


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return LlamaForPretraining(preset("tiny", vocab_size=300, max_position_embeddings=32)).eval()


def test_batched_loglikelihoods_equal_one_forward_per_request(tiny_model):
    requests = random_requests(23, 300)  # some longer than the model's 32 positions
    assert max(len(c) + len(t) for c, t in requests) > 33
    expected = [reference_loglikelihood(tiny_model, c, t) for c, t in requests]
    for budget in (1, 100, 10_000):  # one row per forward, a few, all at once
        got = loglikelihoods(tiny_model, requests, batch_tokens=budget)
        assert got == pytest.approx(expected, abs=1e-5)
    # A continuation with no token of its own (merged into the context's last one) scores 0.
    scores = loglikelihoods(tiny_model, [([0], []), *requests[:1]])
    assert scores == pytest.approx([0.0, expected[0]], abs=1e-5)


def test_acc_and_acc_norm_follow_the_harness():
    examples = [
        multiple_choice("q", ["a", "bbbb"], 1),  # acc picks a (-2 > -4); per char bbbb (-1)
        multiple_choice("q", ["xx", "yy", "zz"], 2),  # a three-way tie: a third of a point
        Example((("c1", " d"), ("c2", " d")), ("c1", "c22"), 0),  # divides by the choice
    ]
    lls = [-2.0, -4.0, -3.0, -3.0, -3.0, -2.0, -2.5]
    assert accuracy(examples, lls) == pytest.approx({"acc": 4 / 9, "acc_norm": 4 / 9, "n": 3})
    assert accuracy(examples[:1], lls[:2]) == {"acc": 0.0, "acc_norm": 1.0, "n": 1}
    assert accuracy(examples[2:], lls[5:]) == {"acc": 1.0, "acc_norm": 0.0, "n": 1}


def test_ties_split_the_credit_and_never_go_to_the_first_choice():
    """A model whose every choice scores the same (a constant or broken model) gets chance, 1/k,
    on a task whose labels are all 0, not 1.0; a tie of two of three choices gives the right one
    half a point, the wrong one none."""
    all_first = [multiple_choice("q", ["a", "b", "c", "d"], 0) for _ in range(5)]
    assert accuracy(all_first, [-1.0] * 20) == {"acc": 0.25, "acc_norm": 0.25, "n": 5}
    pair = [multiple_choice("q", ["x", "y", "z"], 1), multiple_choice("q", ["x", "y", "z"], 2)]
    assert accuracy(pair, [-1.0, -1.0, -5.0] * 2)["acc"] == 0.25  # (1/2 + 0) / 2


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_scores_of_a_model_whose_outputs_are_not_finite_are_nan(bad):
    examples = [multiple_choice("q", ["a", "b"], 0), multiple_choice("q", ["a", "b"], 1)]
    got = accuracy(examples, [-1.0, -2.0, bad, -2.0])
    assert math.isnan(got["acc"]) and math.isnan(got["acc_norm"]) and got["n"] == 2


def test_ranks_share_the_requests_and_run_as_many_forwards(tiny_model, monkeypatch):
    """Two ranks, simulated in this process (the all-reduce left out): each scores its share of
    every batch, the shares make the whole, and both run the same number of forwards, which
    FSDP's collectives need (the real DDP and FSDP runs: test_train's two-process tests)."""
    requests = random_requests(12, 300)
    forwards = []
    hook = tiny_model.register_forward_pre_hook(lambda *_: forwards.append(1))
    expected = loglikelihoods(tiny_model, requests, batch_tokens=100)
    single, shares, counts = len(forwards), [], []
    monkeypatch.setattr(D, "all_reduce_sum", lambda t, rt: t)
    for rank in (0, 1):
        forwards.clear()
        rt = D.Runtime("ddp", torch.device("cpu"), rank=rank, world_size=2)
        shares.append(loglikelihoods(tiny_model, requests, rt=rt, batch_tokens=100))
        counts.append(len(forwards))
    hook.remove()
    assert counts[0] == counts[1] == (single + 1) // 2
    assert all((a == 0) != (b == 0) for a, b in zip(*shares))  # each request on one rank
    assert [a + b for a, b in zip(*shares)] == pytest.approx(expected, abs=1e-5)


def test_scoring_runs_in_eval_mode_under_the_runs_precision(tiny_tokenizer):
    """The evaluator puts a training model in eval mode for its forwards and back after, and
    scores under the precision it is given (bf16 autocast here: not fp32's numbers, close)."""
    from llama_ddp.eval.scoring import TaskEvaluator
    from llama_ddp.eval.tasks import Task
    from llama_ddp.precision import Precision

    rng = random.Random(2)
    examples = [
        multiple_choice(" ".join(rng.choices(WORDS, k=8)), rng.choices(WORDS, k=3), 0)
        for _ in range(6)
    ]
    evaluator = TaskEvaluator([Task("t", examples)], tiny_tokenizer, 0)
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=400))
    modes = []
    model.register_forward_pre_hook(lambda m, _: modes.append(m.training))
    fp32 = evaluator.loglikelihoods(model)["t"]
    bf16 = evaluator.loglikelihoods(model, None, Precision(torch.bfloat16, torch.device("cpu")))
    assert model.training and modes and not any(modes)
    model.eval()
    assert fp32 == pytest.approx([reference_loglikelihood(model, *r) for r in evaluator.requests])
    assert bf16["t"] != fp32 and bf16["t"] == pytest.approx(fp32, rel=0.05)


# ----------------------------------------------------------------------------- in a run, and after


@pytest.mark.e2e
def test_the_loop_logs_each_tasks_scores_with_the_validation_loss(task_run):
    out, _ = task_run
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in evals] == [0, 4, 8, 10]  # every --eval-every steps, and the end
    for r in evals:
        assert r["tasks"].keys() == {"words"}
        assert r["tasks_s"] >= 0  # what scoring the tasks cost
        scores = r["tasks"]["words"]
        assert scores["n"] == 10  # --eval-limit
        assert {scores["acc"] * 10, scores["acc_norm"] * 10} <= set(range(11))
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    for key in ("acc", "acc_norm"):
        logged = [(e.step, e.value) for e in events.Scalars(f"eval/words/{key}")]
        assert logged == [(r["step"], pytest.approx(r["tasks"]["words"][key])) for r in evals]


@pytest.mark.parametrize(
    "line, message",
    [
        (None, "--eval-tasks: unknown task 'nope' (known: arc_challenge"),
        ('{"context": "a", "choices": ["b", "c"], "label": 5}', "bad.jsonl line 2: label 5"),
        ("not json", "bad.jsonl line 2: Expecting value"),
    ],
)
@pytest.mark.e2e
def test_a_bad_task_stops_the_run_before_training(train_env, tmp_path, line, message):
    task = tmp_path / "bad.jsonl"
    good = json.dumps({"context": "a", "choices": ["b", "c"], "label": 0})
    task.write_text(f"{good}\n{line}\n")
    out = tmp_path / "out"
    spec = "nope" if line is None else str(task)
    result = train_here(train_env, [*tiny_args(train_env, out), "--eval-tasks", spec])
    err = result.stderr
    assert result.returncode == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
    assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()


# ----------------------------------------------------------------------------- the harness itself


HARNESS_YAMLS = {  # lm-eval's own task configs, under lm_eval/tasks/
    "hellaswag": "hellaswag/hellaswag.yaml",
    "arc_easy": "arc/arc_easy.yaml",
    "piqa": "piqa/piqa.yaml",
    "winogrande": "winogrande/default.yaml",
}


def harness_task(name: str, split: str, data: str) -> dict:
    """lm-eval's own config of ``name`` (its yaml, prompt functions included), reading ``data``
    (a parquet file in the hub dataset's columns) as its evaluation split."""
    import lm_eval.tasks
    from lm_eval.tasks._yaml_loader import load_yaml

    folder = Path(lm_eval.tasks.__file__).parent
    config = load_yaml(folder / HARNESS_YAMLS[name], resolve_func=True)
    config.pop("tag", None)
    config.update(
        dataset_path="parquet",
        dataset_name=None,
        dataset_kwargs={"data_files": {split: data}},
        training_split=None,
        validation_split=split if split == "validation" else None,
        test_split=split if split == "test" else None,
    )
    return config


def test_scores_equal_lm_evaluation_harness(tmp_path):
    """lm-eval's HFLM on the exported hf/ folder (add_bos_token=True) and our scoring give the
    same log-likelihood for every request (1e-4) and the same acc and acc_norm, on lm-eval's
    own task configs for the hub tasks (local copies) and on a task file."""
    pytest.importorskip("lm_eval")
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from llama_ddp.data.tokenizer import train_tokenizer
    from llama_ddp.data.tokenizer_files import save_tokenizer
    from llama_ddp.eval.scoring import TaskEvaluator
    from llama_ddp.eval.tasks import load_tasks, parse_tasks
    from llama_ddp.interop.hf import export_hf
    from tests.eval.test_tasks import HUB_ROWS, write_hub_copies

    copies = write_hub_copies(tmp_path)
    local = tmp_path / "local_mc.jsonl"
    lines = [
        {"context": "def f(x):\n   ", "choices": ["return x", "pass"], "label": 0},
        {"context": "The man writes", "choices": ["over the snow", "under  the car"], "label": 1},
        {"context": "", "choices": ["Question", "Answer"], "label": 1},  # BOT alone
        {"context": "the snow " * 60, "choices": ["yes", "no"], "label": 0},  # left-truncated
    ]
    local.write_text("".join(json.dumps(line) + "\n" for line in lines))
    texts = [json.dumps(rows) for rows in HUB_ROWS.values()] + [local.read_text()]
    tokenizer = train_tokenizer(texts * 5, 500)
    save_tokenizer(tokenizer, tmp_path / "tokenizer.json")
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=500, max_position_embeddings=96))
    export_hf(model, tmp_path / "hf", tmp_path / "tokenizer.json")

    named = {
        "hellaswag": "hellaswag",
        "arc_easy": "arc",
        "piqa": "piqa",
        "winogrande": "winogrande",
    }
    specs = parse_tasks(",".join([*(f"{t}={copies[k]}" for t, k in named.items()), str(local)]))
    evaluator = TaskEvaluator(load_tasks(specs), tokenizer, special_ids(tokenizer).bot)
    ours, scores = evaluator.loglikelihoods(model.eval()), evaluator(model)

    splits = {"hellaswag": "validation", "arc_easy": "test", "piqa": "validation"}
    configs = [harness_task(t, splits.get(t, "validation"), copies[k]) for t, k in named.items()]
    configs.append(
        {
            "task": "local_mc",
            "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(local)}},
            "test_split": "test",
            "output_type": "multiple_choice",
            "doc_to_text": "{{context}}",
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
        }
    )
    lm = HFLM(pretrained=str(tmp_path / "hf"), add_bos_token=True, batch_size=4, device="cpu")
    manager = TaskManager(include_defaults=False)  # indexing every task of lm-eval takes long
    theirs = simple_evaluate(
        model=lm, tasks=configs, task_manager=manager, log_samples=True, bootstrap_iters=0
    )
    for task in [*named, "local_mc"]:
        samples = sorted(theirs["samples"][task], key=lambda s: s["doc_id"])
        lls = [float(resp[0]) for s in samples for resp in s["filtered_resps"]]
        assert ours[task] == pytest.approx(lls, abs=1e-4), task
        results = theirs["results"][task]
        examples = next(t for t in evaluator.tasks if t.name == task).examples
        for key in ("acc", "acc_norm"):
            if f"{key},none" in results:  # winogrande reports acc alone
                # their log-likelihoods through our formula: the same numbers, exactly
                assert accuracy(examples, lls)[key] == results[f"{key},none"], (task, key)
                # ours, 1e-4 from theirs: the same choices unless two nearly tie
                if _closest_choices(examples, ours[task]) > 2e-4:
                    assert scores[task][key] == results[f"{key},none"], (task, key)
        assert scores[task]["n"] == len(samples)


def _closest_choices(examples: list[Example], lls: list[float]) -> float:
    """The smallest gap between an example's two best log-likelihoods, whole or per character
    (acc_norm's), over ``examples``."""
    gaps, start = [math.inf], 0
    for ex in examples:
        whole = lls[start : start + len(ex.requests)]
        start += len(ex.requests)
        normed = [s / len(c) if c else -math.inf for s, c in zip(whole, ex.choices)]
        for values in (whole, normed):
            second, best = sorted(values)[-2:]
            gaps.append(best - second)
    return min(gaps)
