"""Evaluation tasks: multiple-choice questions posed as lm-evaluation-harness poses them.

One registry, ``TASKS``, names every built-in task; ``--eval-tasks`` (train.py) and ``--tasks``
(``python -m llama_ddp.evaluate``) take a comma list of its names and of local files:

- hub tasks, read with ``datasets`` in lm-eval 0.4's prompt formats (its task yamls): ``hellaswag``,
  ``arc_easy``, ``arc_challenge``, ``piqa``, ``winogrande``. Offline they load from the hub cache,
  or from a local copy in the hub's format: ``hellaswag=PATH``, PATH a data file (.parquet,
  .jsonl, .json, .csv), a ``save_to_disk`` folder or a copy of the hub repository;
- ``stdlib-mc``, built offline from the sample corpus's validation files (stdlib_task.py);
- ``PATH.jsonl``, one ``{"context": str, "choices": [str, ...], "label": int}`` per line, a task
  named by the file's stem.

Nothing here imports ``datasets`` until a task is loaded: config.py checks names with this module.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llama_ddp.errors import UserError

DELIMITER = " "  # lm-eval's default target_delimiter, between a context and each choice


@dataclass(frozen=True)
class Example:
    """One question: ``requests`` holds (context, continuation) per choice, each scored by the
    log-likelihood of its continuation; acc_norm divides it by ``len(choices[i])`` (characters, as
    the harness does); ``label`` is the right choice's index."""

    requests: tuple[tuple[str, str], ...]
    choices: tuple[str, ...]
    label: int


def multiple_choice(
    context: str, choices: list[str], label: int, delimiter: str = DELIMITER
) -> Example:
    """The usual form: one context, each choice its continuation after ``delimiter``."""
    return Example(tuple((context, delimiter + c) for c in choices), tuple(choices), label)


def partial(contexts: list[str], continuation: str, label: int) -> Example:
    """Winogrande's partial scoring: the context varies with the choice, the continuation is
    shared; the harness's choices are then the contexts (what acc_norm divides by)."""
    return Example(tuple((c, DELIMITER + continuation) for c in contexts), tuple(contexts), label)


@dataclass(frozen=True)
class Task:
    name: str
    examples: list[Example]


# ----------------------------------------------------------------------------- hub tasks


def _hellaswag_text(text: str) -> str:
    text = text.strip()
    text = text.replace(" [title]", ". ")  # bracketed artifacts of HellaSwag's WikiHow part
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def _hellaswag(row: dict[str, Any]) -> Example:
    context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    query = _hellaswag_text(row["activity_label"] + ": " + context)
    return multiple_choice(query, [_hellaswag_text(e) for e in row["endings"]], int(row["label"]))


def _arc(row: dict[str, Any]) -> Example:
    choices = row["choices"]
    label = choices["label"].index(row["answerKey"])
    return multiple_choice(f"Question: {row['question']}\nAnswer:", choices["text"], label)


def _piqa(row: dict[str, Any]) -> Example:
    context = f"Question: {row['goal']}\nAnswer:"
    return multiple_choice(context, [row["sol1"], row["sol2"]], int(row["label"]))


def _winogrande(row: dict[str, Any]) -> Example:
    sentence = row["sentence"]
    blank = sentence.index("_")
    contexts = [sentence[:blank] + row["option1"], sentence[:blank] + row["option2"]]
    return partial(contexts, sentence[blank + 1 :].strip(), {"1": 0, "2": 1}[row["answer"]])


@dataclass(frozen=True)
class HubTask:
    """A task read from a hub dataset: the split lm-eval evaluates, each row made an Example."""

    path: str
    config: str | None
    split: str
    example: Callable[[dict[str, Any]], Example]

    def load(
        self, name: str, local: Path | None, limit: int | None, cache_dir: Path | None
    ) -> list[Example]:
        rows = _hub_rows(self, name, local)
        count = len(rows) if limit is None else min(limit, len(rows))
        examples = []
        for i, row in enumerate(rows.select(range(count))):
            try:
                examples.append(self.example(row))
            except (KeyError, ValueError, TypeError, AttributeError) as exc:
                raise UserError(
                    f"task {name}: row {i} of {local or self.path} is not in the format of "
                    f"{self.path} ({type(exc).__name__}: {exc}; its columns: "
                    f"{', '.join(rows.column_names)}) (give a copy of {self.path})"
                ) from exc
        return examples


@dataclass(frozen=True)
class BuiltTask:
    """A task built offline from the sample corpus (stdlib_task.py)."""

    def load(
        self, name: str, local: Path | None, limit: int | None, cache_dir: Path | None
    ) -> list[Example]:
        from llama_ddp.eval.stdlib_task import stdlib_questions

        questions = stdlib_questions(cache_dir)[:limit]
        return [multiple_choice(c, choices, label, "\n") for c, choices, label in questions]


# The registry: every built-in task by name (lm-eval's names and splits).
TASKS: dict[str, HubTask | BuiltTask] = {
    "hellaswag": HubTask("Rowan/hellaswag", None, "validation", _hellaswag),
    "arc_easy": HubTask("allenai/ai2_arc", "ARC-Easy", "test", _arc),
    "arc_challenge": HubTask("allenai/ai2_arc", "ARC-Challenge", "test", _arc),
    "piqa": HubTask("baber/piqa", None, "validation", _piqa),
    "winogrande": HubTask("allenai/winogrande", "winogrande_xl", "validation", _winogrande),
    "stdlib-mc": BuiltTask(),
}

_DATA_FILES = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}


def _hub_rows(task: HubTask, name: str, local: Path | None) -> Any:
    """The rows of ``task``'s split: from the hub (or its cache), or from the local copy."""
    import datasets

    where = str(local) if local else task.path
    try:
        if local is None or local.is_dir() and not _is_saved(local):
            return datasets.load_dataset(where, task.config, split=task.split)
        if local.is_dir():
            saved = datasets.load_from_disk(where)
            if isinstance(saved, datasets.DatasetDict):
                if task.split not in saved:
                    raise UserError(
                        f"task {name}: {local} has no split {task.split!r}; its splits are "
                        f"{', '.join(saved)} (save the {task.split} split of {task.path})"
                    )
                return saved[task.split]
            return saved
        return datasets.load_dataset(_DATA_FILES[local.suffix], data_files=where, split="train")
    except (ConnectionError, FileNotFoundError) as exc:
        raise UserError(
            f"task {name} reads the hub dataset {task.path}, which this machine cannot fetch "
            f"({type(exc).__name__}: {exc}) (download it once with network access, or name a "
            f"local copy in the task list: {name}=PATH)"
        ) from exc
    except (ValueError, OSError, datasets.exceptions.DatasetGenerationError) as exc:
        raise UserError(f"task {name}: cannot read {where}: {exc} (check the copy)") from exc


def _is_saved(folder: Path) -> bool:
    """A folder written by ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


# ----------------------------------------------------------------------------- local files


_FORMAT = '{"context": str, "choices": [str, ...], "label": int}'


def read_jsonl_task(path: Path, limit: int | None = None) -> list[Example]:
    """The examples of a task file, each line checked (the file and line named on error)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"task file {path} is not readable UTF-8 text ({exc})") from exc
    examples = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if limit is not None and len(examples) == limit:
            break
        try:
            examples.append(_jsonl_example(line))
        except ValueError as exc:
            raise UserError(
                f"{path} line {number}: {exc} (each line is one JSON object {_FORMAT})"
            ) from exc
    if not examples:
        raise UserError(f"task file {path} has no examples (add lines {_FORMAT})")
    return examples


def _jsonl_example(line: str) -> Example:
    row = json.loads(line)  # a JSONDecodeError is a ValueError
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    context, choices, label = row.get("context"), row.get("choices"), row.get("label")
    if not isinstance(context, str):
        raise ValueError(f'"context" is {context!r}, not a string')
    if not (isinstance(choices, list) and len(choices) >= 2):
        raise ValueError(f'"choices" is {choices!r}, not a list of two or more strings')
    if not all(isinstance(c, str) and c for c in choices):
        raise ValueError('"choices" holds something other than non-empty strings')
    if not isinstance(label, int) or isinstance(label, bool):
        raise ValueError(f'"label" is {label!r}, not an integer')
    if not 0 <= label < len(choices):
        raise ValueError(f"label {label} is out of range for {len(choices)} choices")
    return multiple_choice(context, choices, label)


# ----------------------------------------------------------------------------- a task list


@dataclass(frozen=True)
class TaskSpec:
    """One entry of a task list: a registered task (with a local copy of its data, or not), or a
    task file."""

    name: str
    path: Path | None = None

    def load(self, limit: int | None = None, cache_dir: Path | None = None) -> Task:
        if self.name in TASKS:
            examples = TASKS[self.name].load(self.name, self.path, limit, cache_dir)
        else:
            examples = read_jsonl_task(self.path, limit)
        if not examples:
            raise UserError(f"task {self.name} has no examples (check its data)")
        return Task(self.name, examples)


def parse_tasks(text: str | None, flag: str = "--eval-tasks") -> list[TaskSpec]:
    """The tasks of a comma list, checked without reading any data: each a known name,
    ``NAME=PATH`` (a hub task's local copy) or an existing ``.jsonl`` file; no name twice."""
    specs = []
    for item in (p.strip() for p in (text or "").split(",")):
        if not item:
            continue
        name, _, copy = item.partition("=")
        if copy:
            if not isinstance(TASKS.get(name), HubTask):
                hub = ", ".join(n for n, t in TASKS.items() if isinstance(t, HubTask))
                raise UserError(f"{flag} {item!r}: only a hub task ({hub}) takes =PATH")
            spec = TaskSpec(name, _existing(Path(copy).expanduser(), flag, item))
        elif name in TASKS:
            spec = TaskSpec(name)
        elif name.endswith(".jsonl"):
            path = _existing(Path(name).expanduser(), flag, item)
            spec = TaskSpec(path.stem, path)
        else:
            raise UserError(
                f"{flag}: unknown task {name!r} (known: {', '.join(sorted(TASKS))}; or a "
                f".jsonl file of lines {_FORMAT})"
            )
        if spec.name in (s.name for s in specs):
            raise UserError(f"{flag} names the task {spec.name!r} twice (rename a task file)")
        specs.append(spec)
    return specs


def _existing(path: Path, flag: str, item: str) -> Path:
    if not path.exists():
        raise UserError(f"{flag} {item!r}: {path} not found (check the path)")
    if path.is_file() and path.suffix not in _DATA_FILES:
        raise UserError(f"{flag} {item!r}: {path} is not a {', '.join(_DATA_FILES)} file")
    return path


def load_tasks(
    specs: list[TaskSpec], limit: int | None = None, cache_dir: Path | None = None
) -> list[Task]:
    """Every task of the list with its first ``limit`` examples (all with None); ``cache_dir``
    holds the sample corpus stdlib-mc is built from (default: the run's default)."""
    return [spec.load(limit, cache_dir) for spec in specs]
