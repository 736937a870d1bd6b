"""evaluate.py: ``python -m llama_ddp.evaluate``: the table it prints, and every mistake one line
and exit code 2."""

import pytest

from llama_ddp.evaluate import format_table, main


def test_the_table_has_a_row_per_task_aligned_under_its_header():
    scores = {
        "stdlib-mc": {"acc": 0.37, "acc_norm": 0.405, "n": 370},
        "a": {"acc": 1.0, "acc_norm": 0.5, "n": 2},
    }
    assert format_table(scores).splitlines() == [
        "task            n      acc  acc_norm",
        "stdlib-mc     370   0.3700    0.4050",
        "a               2   1.0000    0.5000",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "nope"], "unknown task 'nope' (known: arc_challenge, arc_easy, hellaswag"),
        (["--tasks", "{task}", "--limit", "0"], "--limit 0 must be >= 1"),
        (["--model", "{out}/nowhere", "--tasks", "{task}"], "nowhere not found"),
        (["--tasks", "{task}", "--tokenizer", "{tokenizer}"], "another tokenizer"),
    ],
)
@pytest.mark.e2e
def test_bad_evaluate_input_is_one_line(task_run, train_env, args, message, capsys, tmp_path):
    from llama_ddp.data.tokenizer import train_tokenizer
    from llama_ddp.data.tokenizer_files import save_tokenizer

    out, task = task_run
    other = tmp_path / "other.json"
    save_tokenizer(train_tokenizer(["a b c d e f"] * 5, 280), other)
    fill = {"{task}": str(task), "{out}": str(out), "{tokenizer}": str(other)}
    args = [fill.get(a, a).replace("{out}", str(out)) for a in args]
    if "--model" not in args:
        args = ["--model", str(out / "checkpoints" / "step-00000004"), *args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err
