"""metrics.py: MFU and the peak it is measured against, tokens/s, where the time went,
metrics.jsonl, the log sinks."""

import time

import pytest
import torch

from llama_ddp.train.metrics import (
    METRICS_FILE,
    SCALARS,
    TENSORBOARD_DIR,
    WANDB_ID_FILE,
    Reporter,
    Throughput,
    TimeSpent,
    gpu_peak_flops,
    measure_matmul_flops,
    mfu,
    peak_flops,
    read_records,
    time_line,
)


def test_mfu_is_achieved_over_peak():
    assert mfu(6e9, 1000.0, 12e12) == pytest.approx(0.5)
    assert mfu(6e9, 1000.0, 0.0) == 0.0


def test_gpu_peak_table():
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA H100 PCIe", torch.bfloat16) == 756e12
    assert gpu_peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835e12  # not the SXM peak
    assert gpu_peak_flops("NVIDIA H200 NVL", torch.bfloat16) == 835e12
    assert gpu_peak_flops("NVIDIA L40", torch.bfloat16) == 181e12  # not "L4"
    assert gpu_peak_flops("NVIDIA L40S", torch.bfloat16) == 362e12
    assert gpu_peak_flops("NVIDIA L4", torch.bfloat16) == 121e12
    assert gpu_peak_flops("NVIDIA H200", torch.bfloat16) == 989e12
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32) == 19.5e12
    # fp32 matmuls on TF32 tensor cores (what a CUDA fp32 run does): the TF32 peak, not fp32's
    # (against which MFU could read over 100%); a GPU without TF32 keeps its fp32 peak
    assert gpu_peak_flops("NVIDIA A100-SXM4-80GB", torch.float32, tf32=True) == 156e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.float32, tf32=True) == 494.7e12
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.float32, tf32=True) == 15.7e12
    assert gpu_peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16, tf32=True) == 989e12
    assert gpu_peak_flops("Some Future GPU", torch.bfloat16) is None


def test_peak_override_and_cpu_measurement():
    assert peak_flops(torch.device("cpu"), torch.float32, 2.5) == 2.5e12
    measured = measure_matmul_flops(size=256, trials=2, seconds=0.02)
    assert 1e8 < measured < 1e14


@pytest.mark.parametrize("seconds_per_flop", [1e-11, 1e-9], ids=["native", "emulated"])
def test_the_cpu_peak_is_measured_on_matrices_the_dtype_multiplies_quickly(
    monkeypatch, seconds_per_flop
):
    """On a clock where a product of side n takes 2 n^3 x seconds_per_flop: a fast dtype is
    measured on 1024^3 products, one the CPU emulates (256^3 takes 34 ms, 1024^3 would take 2 s
    each) stays at 256, and both read the clock's FLOP/s."""
    from llama_ddp.train import metrics

    clock, sides = [0.0], []

    def mm(a, b):
        sides.append(a.shape[0])
        clock[0] += 2 * a.shape[0] ** 3 * seconds_per_flop

    monkeypatch.setattr(metrics.torch, "mm", mm)
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: clock[0])
    flops = measure_matmul_flops(torch.float16, trials=2, seconds=0.1)
    assert flops == pytest.approx(1 / seconds_per_flop)
    assert max(sides) == (1024 if seconds_per_flop < 1e-10 else 256)
    assert clock[0] < 1.0  # the whole measurement: under a second of the clock


def test_throughput_leaves_out_paused_time():
    t = Throughput()
    t.add(1000)
    with t.paused():  # an evaluation: 0.3 s that are not training
        time.sleep(0.3)
    assert t.read() > 1000 / 0.1  # counted over the unpaused microseconds, not over 0.3 s
    t.add(500)
    time.sleep(0.05)
    assert 500 / 0.5 < t.read() <= 500 / 0.05  # the window restarts at each read


def test_time_spent_adds_each_lap_to_its_phase_and_resumes(monkeypatch):
    from llama_ddp.train import metrics

    clock = iter([10.0, 12.5, 20.0, 21.0, 21.25])
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    spent = TimeSpent()
    spent.load_state_dict({"train_s": 100.0, "eval_s": 4.0})  # a resumed run's checkpoint
    spent.start()  # 10
    spent.lap("data_s")  # 12.5
    spent.lap("train_s")  # 20
    spent.lap("eval_s")  # 21
    spent.lap("save_s")  # 21.25
    assert spent.record() == {
        "train_s": 107.5, "eval_s": 5.0, "save_s": 0.25, "data_s": 2.5, "total_s": 115.25,
    }  # fmt: skip
    assert time_line(spent.record()) == (
        "where the time went (115.2 s): training steps 107.5 s (93.3%), evaluation 5.0 s (4.3%), "
        "checkpoints 0.2 s (0.2%), waiting for data 2.5 s (2.2%)"
    )
    assert TimeSpent().record()["total_s"] == 0 and "(0.0%)" in time_line(TimeSpent().record())


def test_mfu_never_exceeds_100_percent_when_the_measured_peak_read_low(monkeypatch):
    from llama_ddp.train import metrics

    readings = iter([1e9, 2e9])  # start-up reading during a busy spell, then a second one
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype: next(readings))
    peak = metrics.Peak(torch.device("cpu"), torch.float32, None, devices=1)
    assert peak.flops == 1e9
    assert peak.mfu(1e6, 4000.0) == 1.0  # 4 GFLOP/s achieved: above both readings
    assert peak.flops == 4e9  # never below what the run achieved
    assert peak.mfu(1e6, 2000.0) == pytest.approx(0.5)
    given = metrics.Peak(torch.device("cpu"), torch.float32, 0.001, devices=2)  # --peak-tflops
    assert given.flops == 2e9 and given.mfu(1e6, 1000.0) == pytest.approx(0.5)


def test_a_torn_last_line_is_dropped_and_other_damage_is_an_error(tmp_path, capsys):
    from llama_ddp.errors import UserError
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
            reporter.log({**record, "val_loss_by_source": by_source})
        if step % 4 == 0:
            reporter.log({"step": step, "checkpoint": f"step-{step}", "save_s": 0.5 + step})
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
