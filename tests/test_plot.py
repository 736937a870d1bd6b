"""plot.py: ``python -m llama_ddp.plot``, a run's curves from its metrics.jsonl (a loss line per
source, task accuracies, the lr), and its one-line refusals."""

from __future__ import annotations

import json

import pytest

from llama_ddp.errors import UserError
from llama_ddp.plot import loss_curves, main, plot, task_curves
from llama_ddp.train.metrics import read_metrics

TRAIN = [{"step": s, "loss": 6.0 - s, "lr": 1e-3 * s, "tokens": 100 * s} for s in (1, 2, 3, 4)]
EVALS = [
    {"step": 0, "val_loss": 5.5, "val_loss_by_source": {"code": 5.0, "prose": 7.0}},
    {"step": 2, "val_loss": 4.5, "val_loss_by_source": {"code": 4.0, "prose": 6.0, "web": 9.0}},
    {"step": 4, "val_loss": 3.5, "val_loss_by_source": {"code": 3.0, "prose": 5.0}},
]
TASKS = [
    {"step": 0, "tasks": {"words": {"acc": 0.2, "acc_norm": 0.1, "n": 10}}},
    {"step": 4, "tasks": {"words": {"acc": 0.6, "acc_norm": 0.3, "n": 10}}},
]


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_the_loss_panel_has_a_line_per_source_at_the_steps_it_was_measured():
    assert loss_curves(TRAIN, EVALS) == {
        "train loss": ([1, 2, 3, 4], [5.0, 4.0, 3.0, 2.0]),
        "validation loss": ([0, 2, 4], [5.5, 4.5, 3.5]),
        "validation loss: code": ([0, 2, 4], [5.0, 4.0, 3.0]),
        "validation loss: prose": ([0, 2, 4], [7.0, 6.0, 5.0]),
        "validation loss: web": ([2], [9.0]),
    }
    assert task_curves(TASKS) == {
        "words acc": ([0, 4], [0.2, 0.6]),
        "words acc_norm": ([0, 4], [0.1, 0.3]),
    }


@pytest.mark.parametrize("tasks", [False, True])
def test_the_png_draws_every_curve(tmp_path, monkeypatch, tasks):
    """What the figure holds: each panel's lines, by label, with their points."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig) or close(fig))
    records = [TRAIN[0], EVALS[0], *TRAIN[1:], *EVALS[1:], *(TASKS if tasks else [])]
    metrics = write_metrics(tmp_path / "metrics.jsonl", records)
    png = plot(metrics, tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figures
    panels = [
        {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.lines}
        for ax in fig.axes
    ]
    evals = [r for r in records if "val_loss" in r or "tasks" in r]
    assert panels[0] == loss_curves(TRAIN, evals) and len(panels[0]) == 5
    assert panels[1:-1] == ([task_curves(TASKS)] if tasks else [])
    assert list(panels[-1].values()) == [([1, 2, 3, 4], [1e-3, 2e-3, 3e-3, 4e-3])]


def test_what_cannot_be_drawn_is_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match="missing.jsonl not found"):
        read_metrics(tmp_path / "missing.jsonl")
    empty = write_metrics(tmp_path / "metrics.jsonl", [{"step": 0, "note": "started"}])
    with pytest.raises(UserError, match="has no training or evaluation records yet"):
        read_metrics(empty)
    assert main([str(empty)]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {empty} has no training or evaluation records yet\n"
    assert not (tmp_path / "curves.png").exists()


@pytest.mark.e2e
def test_plot_draws_the_curves(full_run, tmp_path):
    pytest.importorskip("matplotlib")
    assert main([str(full_run / "metrics.jsonl"), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "missing.jsonl")]) == 2


@pytest.mark.e2e
def test_plot_draws_the_task_curves(task_run, tmp_path):
    pytest.importorskip("matplotlib")
    out, _ = task_run
    _, evals = read_metrics(out / "metrics.jsonl")
    curves = task_curves(evals)
    assert curves.keys() == {"words acc", "words acc_norm"}
    assert curves["words acc"] == ([0, 4, 8, 10], [r["tasks"]["words"]["acc"] for r in evals])
    assert main([str(out / "metrics.jsonl"), "-o", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_folder_it_cannot_write_is_said_as_every_command_says_it(tmp_path, capsys, monkeypatch):
    """Issue 60, item 12: the default curves.png beside metrics.jsonl on a read-only disk said
    "Read-only file system; 26.0 MB free (free some space ...)". Now the line the other
    commands give for a folder they cannot write, before anything is drawn."""
    import os

    folder = tmp_path / "ro"
    folder.mkdir()
    metrics = write_metrics(folder / "metrics.jsonl", TRAIN)
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and p != folder)
    assert main([str(metrics)]) == 2
    assert capsys.readouterr().err == (
        f"error: --out {folder / 'curves.png'}: {folder} is not writable (choose another path)\n"
    )
    assert sorted(p.name for p in folder.iterdir()) == ["metrics.jsonl"]
