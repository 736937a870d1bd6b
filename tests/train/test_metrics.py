"""metrics.py: metrics.jsonl and reading it back, and the log sinks. The curves drawn from it:
tests/test_plot.py."""

from __future__ import annotations

import pytest

from llama_ddp.errors import UserError
from llama_ddp.train.metrics import (
    METRICS_FILE,
    SCALARS,
    TENSORBOARD_DIR,
    WANDB_ID_FILE,
    Reporter,
    read_records,
)


def test_a_torn_last_line_is_dropped_and_other_damage_is_an_error(tmp_path, capsys):
    from llama_ddp.train.metrics import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_records(path) == [{"step": 1, "loss": 2.0}]
    assert "dropping its torn last line" in capsys.readouterr().err
    path.write_text('{"step": 1, "lo\n{"step": 2, "loss": 2.0}\n')
    with pytest.raises(UserError, match="line 1 is not JSON"):
        read_records(path)


def train_record(step: int, loss: float) -> dict:
    return dict(step=step, loss=loss, lr=1e-3 / step, grad_norm=0.5, tokens_per_s=1e4, mfu=0.25)


def report(out_dir, start: int, stop: int, offset: float, loggers: list[str]) -> None:
    """What a run starting after ``start`` reports up to ``stop`` (evaluating every 3 steps,
    saving every 4)."""
    reporter = Reporter(out_dir, 10, start, enabled=True, loggers=loggers, run_config={"lr": 1e-3})
    for step in range(start + 1, stop + 1):
        reporter.log(train_record(step, offset + 1 / step))
        if step % 3 == 0:
            by_source = {"code": offset + 1 / step, "prose": offset + 3 / step}
            record = {"step": step, "val_loss": offset + 2 / step, "val_perplexity": 7.0}
            record["val_bpb"] = 0.5 + 1 / step
            reporter.log({**record, "val_loss_by_source": by_source})
        if step % 4 == 0:
            saved = {"save_s": 0.5 + step, "save_blocked_s": 0.25}
            reporter.log({"step": step, "checkpoint": f"step-{step}", **saved})
    reporter.close()


def test_tensorboard_has_every_logged_scalar_and_a_resume_adds_no_duplicate_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    report(tmp_path, 0, 7, 0.0, ["tensorboard"])  # interrupted after step 7
    report(tmp_path, 4, 10, 100.0, ["tensorboard"])  # resumed from its checkpoint at step 4
    records = read_records(tmp_path / METRICS_FILE)
    events = EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    for key, tag in SCALARS.items():
        logged = [(r["step"], r[key]) for r in records if key in r]
        scalars = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in scalars] == [s for s, _ in logged], tag  # each step once, in order
        assert [v for _, v in scalars] == pytest.approx([v for _, v in logged], rel=1e-6), tag
    losses = [e.value for e in events.Scalars("train/loss")]
    assert losses[3:5] == pytest.approx([1 / 4, 100 + 1 / 5])  # the resumed run's from step 5
    for name, n in (("code", 1), ("prose", 3)):  # each source's validation loss: one tag each
        scalars = [(e.step, e.value) for e in events.Scalars(f"val/loss/{name}")]
        assert scalars == [(3, pytest.approx(n / 3)), (6, pytest.approx(100 + n / 6))] + [
            (9, pytest.approx(100 + n / 9))
        ]


def test_wandb_offline_logs_the_same_scalars_and_resumes_its_run(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    sent = []
    log = wandb.sdk.wandb_run.Run.log

    def spy(run, data, step=None, **kwargs):
        sent.append((run.id, step, dict(data)))
        return log(run, data, step=step, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    report(tmp_path, 0, 7, 0.0, ["wandb"])
    run_id = (tmp_path / WANDB_ID_FILE).read_text().strip()
    report(tmp_path, 4, 10, 100.0, ["wandb"])  # resumed: the same W&B run
    assert (tmp_path / WANDB_ID_FILE).read_text().strip() == run_id
    assert {i for i, _, _ in sent} == {run_id}
    assert list((tmp_path / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    steps = [step for _, step, _ in sent]
    assert steps == [1, 2, 3, 3, 4, 4, 5, 6, 6, 7] + [5, 6, 6, 7, 8, 8, 9, 9, 10]
    assert sent[0][2] == {
        "train/loss": 1.0,
        "train/lr": 1e-3,
        "train/grad_norm": 0.5,
        "train/tokens_per_s": 1e4,
        "train/mfu": 0.25,
    }
    assert sent[3][2] == {
        "val/loss": 2 / 3,
        "val/perplexity": 7.0,
        "val/loss/code": 1 / 3,
        "val/loss/prose": 1.0,
    }
    assert sent[5][2] == {"checkpoint/save_s": 4.5}


def test_every_logger_gets_each_tasks_scores(tmp_path, monkeypatch, capsys):
    """An evaluation with --eval-tasks: every sink (TensorBoard's, W&B's) gets eval/<task>/acc,
    eval/<task>/acc_norm and eval/tasks_s beside val/loss; the console shows the accuracies."""
    from llama_ddp.train import metrics

    sent = []

    class Spy:
        def log(self, step, values):
            sent.append((step, values))

        def close(self):
            pass

    monkeypatch.setitem(metrics.SINKS, "spy", metrics.SinkKind(lambda *_: Spy(), "spy", ""))
    reporter = Reporter(tmp_path, 10, 0, enabled=True, loggers=["spy"])
    tasks = {
        "hellaswag": {"acc": 0.25, "acc_norm": 0.5, "n": 4},
        "mine": {"acc": 1.0, "acc_norm": 0.0, "n": 1},
    }
    reporter.log(
        {"step": 3, "val_loss": 2.0, "val_perplexity": 7.4, "tasks": tasks, "tasks_s": 1.5}
    )
    reporter.close()
    assert sent == [
        (
            3,
            {
                "val/loss": 2.0,
                "val/perplexity": 7.4,
                "eval/tasks_s": 1.5,
                "eval/hellaswag/acc": 0.25,
                "eval/hellaswag/acc_norm": 0.5,
                "eval/mine/acc": 1.0,
                "eval/mine/acc_norm": 0.0,
            },
        )
    ]
    assert read_records(tmp_path / METRICS_FILE)[0]["tasks"] == tasks
    out = capsys.readouterr()
    assert "step 3: val_loss 2.0000 perplexity 7.40 | hellaswag acc 0.250 acc_norm 0.500" in (
        out.out + out.err
    )
