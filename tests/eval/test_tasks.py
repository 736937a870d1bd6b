"""Tasks: lm-eval's prompt formats from hub-format copies, task files, the task list, stdlib-mc."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llama_ddp.errors import UserError
from llama_ddp.eval.tasks import TASKS, load_tasks, parse_tasks, read_jsonl_task

# Rows in the columns of each hub dataset (Rowan/hellaswag, allenai/ai2_arc, baber/piqa,
# allenai/winogrande), with the quirks the prompt formats handle.
HUB_ROWS = {
    "hellaswag": [
        {
            "ind": 4,
            "activity_label": "Removing ice from car",
            "ctx_a": "Then, the man writes over the snow covering the window of a car.",
            "ctx_b": "then",
            "ctx": "",
            "endings": [
                ", the man adds wax to the windshield.",
                ", the man puts on a coat.",
                ", a woman sleds.",
                ", the man continues removing the snow.",
            ],
            "source_id": "a",
            "split": "val",
            "split_type": "indomain",
            "label": "3",
        },
        {
            "ind": 9,
            "activity_label": "Health",
            "ctx_a": "[header] How to cure a cold [title] Drink  fluids. [step] Water helps.",
            "ctx_b": "YOU should",
            "ctx": "",
            "endings": ["rest [substeps] a lot.", "run far.", "eat  snow [title] now.", "sing."],
            "source_id": "b",
            "split": "val",
            "split_type": "zeroshot",
            "label": "0",
        },
    ],
    "arc": [
        {
            "id": "a",
            "question": "Which of these is a gas at room temperature?",
            "choices": {"text": ["iron", "oxygen", "salt", "wood"], "label": ["A", "B", "C", "D"]},
            "answerKey": "B",
        },
        {
            "id": "b",
            "question": "What do plants need?",
            "choices": {"text": ["light", "darkness", "noise"], "label": ["1", "2", "3"]},
            "answerKey": "1",
        },
    ],
    "piqa": [
        {"goal": "Open a jar", "sol1": "Twist the lid.", "sol2": "Twist the jar.", "label": 1}
    ],
    "winogrande": [
        {
            "sentence": "Sarah was a better surgeon than Maria so _ got the harder cases.",
            "option1": "Sarah",
            "option2": "Maria",
            "answer": "1",
        },
        {
            "sentence": "The trophy does not fit into the case because the _ is too large.",
            "option1": "trophy",
            "option2": "case",
            "answer": "2",
        },
    ],
}


def write_hub_copies(folder) -> dict[str, str]:
    """Each hub task's rows as a parquet file in its hub columns: NAME=PATH for --eval-tasks."""
    paths = {}
    for key, rows in HUB_ROWS.items():
        path = folder / f"{key}.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
        paths[key] = str(path)
    return paths


def test_hub_tasks_pose_the_questions_in_lm_evals_formats(tmp_path):
    paths = write_hub_copies(tmp_path)
    spec = ",".join(
        f"{name}={paths[key]}"
        for name, key in [
            ("hellaswag", "hellaswag"),
            ("arc_easy", "arc"),
            ("piqa", "piqa"),
            ("winogrande", "winogrande"),
        ]
    )
    hellaswag, arc, piqa, winogrande = load_tasks(parse_tasks(spec))
    first, second = hellaswag.examples
    # activity label, ": ", ctx_a, " ", ctx_b capitalized (the rest lower-cased)
    assert first.requests[3] == (
        "Removing ice from car: Then, the man writes over the snow covering the window of a car. "
        "Then",
        " , the man continues removing the snow.",
    )
    assert first.label == 3 and first.choices[0] == ", the man adds wax to the windshield."
    # WikiHow artifacts: " [title]" becomes ". ", other brackets go, double spaces close up
    assert (
        second.requests[0][0] == "Health: How to cure a cold. Drink fluids. Water helps. You should"
    )
    assert second.choices == ("rest a lot.", "run far.", "eat snow. now.", "sing.")
    assert second.label == 0
    assert arc.examples[0].requests[1] == (
        "Question: Which of these is a gas at room temperature?\nAnswer:",
        " oxygen",
    )
    assert [e.label for e in arc.examples] == [1, 0]
    assert len(arc.examples[1].requests) == 3
    assert piqa.examples[0].requests == (
        ("Question: Open a jar\nAnswer:", " Twist the lid."),
        ("Question: Open a jar\nAnswer:", " Twist the jar."),
    )
    assert piqa.examples[0].label == 1
    # Winogrande's partial scoring: the option completes the context, the rest is shared
    assert winogrande.examples[1].requests == (
        ("The trophy does not fit into the case because the trophy", " is too large."),
        ("The trophy does not fit into the case because the case", " is too large."),
    )
    assert winogrande.examples[1].choices == tuple(c for c, _ in winogrande.examples[1].requests)
    assert [e.label for e in winogrande.examples] == [0, 1]


def test_local_copies_load_as_saved_datasets_and_hub_folders(tmp_path):
    """A save_to_disk folder and a copy of the hub repository (data/<split>-*.parquet, read by
    the code path a hub id takes) give the rows of a data file; --eval-limit takes the first."""
    import datasets

    rows = HUB_ROWS["hellaswag"]
    datasets.DatasetDict({"validation": datasets.Dataset.from_list(rows)}).save_to_disk(
        tmp_path / "saved"
    )
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(
        pa.Table.from_pylist(rows), tmp_path / "repo/data/validation-00000-of-00001.parquet"
    )
    copy = write_hub_copies(tmp_path)["hellaswag"]
    tasks = [
        load_tasks(parse_tasks(f"hellaswag={p}"), limit)[0]
        for p, limit in [(copy, None), (tmp_path / "saved", None), (tmp_path / "repo", 1)]
    ]
    assert tasks[0].examples == tasks[1].examples
    assert tasks[2].examples == tasks[0].examples[:1]


def test_a_hub_task_offline_without_its_data_is_one_line():
    with pytest.raises(
        UserError, match=r"Rowan/hellaswag.*local copy in the task list: hellaswag=PATH"
    ):
        load_tasks(parse_tasks("hellaswag"))


def test_a_copy_in_another_format_names_its_columns(tmp_path):
    path = tmp_path / "wrong.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": 1}) + "\n")
    with pytest.raises(UserError, match=r"not in the format of baber/piqa.*question, answer"):
        load_tasks(parse_tasks(f"piqa={path}"))


def test_a_task_file_is_read_line_by_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [{"context": "2 + 2 =", "choices": ["4", "5"], "label": 0}, {}, {}]
    path.write_text(json.dumps(lines[0]) + "\n\n" + json.dumps({**lines[0], "label": 1}) + "\n")
    (task,) = load_tasks(parse_tasks(str(path)))
    assert task.name == "mine"
    assert task.examples[0].requests == (("2 + 2 =", " 4"), ("2 + 2 =", " 5"))
    assert [e.label for e in task.examples] == [0, 1]
    assert len(read_jsonl_task(path, limit=1)) == 1


@pytest.mark.parametrize(
    "line, message",
    [
        ("{not json", "Expecting property name"),
        ('["a"]', "not a JSON object"),
        ('{"choices": ["a", "b"], "label": 0}', '"context" is None'),
        ('{"context": "c", "choices": ["a"], "label": 0}', "two or more strings"),
        ('{"context": "c", "choices": ["a", ""], "label": 0}', "non-empty strings"),
        ('{"context": "c", "choices": ["a", "b"], "label": true}', "not an integer"),
        ('{"context": "c", "choices": ["a", "b"], "label": 2}', "label 2 is out of range"),
        ('{"context": "c", "choices": ["a", "b"], "label": -1}', "label -1 is out of range"),
    ],
)
def test_a_malformed_task_line_names_the_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"context": "c", "choices": ["a", "b"], "label": 0})
    path.write_text(good + "\n" + line + "\n")
    with pytest.raises(UserError, match=rf"{re.escape(str(path))} line 2: .*{message}"):
        read_jsonl_task(path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("nope", "unknown task 'nope' \\(known: arc_challenge, arc_easy, hellaswag, piqa, stdlib"),
        ("missing.jsonl", "missing.jsonl not found"),
        ("stdlib-mc=x.parquet", "only a hub task .* takes =PATH"),
        ("piqa,piqa", "names the task 'piqa' twice"),
    ],
)
def test_a_bad_task_list_is_refused_before_any_data_is_read(text, message):
    with pytest.raises(UserError, match=message):
        parse_tasks(text)


def test_the_registry_holds_lm_evals_tasks_and_the_offline_one():
    assert set(TASKS) == {"hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande"} | {
        "stdlib-mc"
    }
