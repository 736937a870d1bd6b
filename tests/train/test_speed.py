"""speed.py: tokens/s, MFU against a measured or tabled peak, and where a run's time goes;
--profile-steps writes a trace of those steps; a CUDA out-of-memory error is one line, with the
memory snapshot it saved."""

import json
import time

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.run import run
from llama_ddp.train.speed import (
    PROFILE_DIR,
    StepProfiler,
    Throughput,
    TimeSpent,
    check_steps,
    gpu_peak_flops,
    measure_matmul_flops,
    mfu,
    parse_steps,
    peak_flops,
    time_line,
)
from tests.helpers.runs import run_train, tiny_args


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
    from llama_ddp.train import speed as metrics

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
    from llama_ddp.train import speed as metrics

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
    # The line's total is metrics.jsonl's total_s, not the sum of the rounded phases (0.448).
    spent.load_state_dict(dict.fromkeys(("train_s", "eval_s", "save_s", "data_s"), 0.11249))
    assert spent.record()["total_s"] == 0.45
    assert time_line(spent.record()).startswith(f"where the time went ({0.45:.1f} s): ")


def test_mfu_never_exceeds_100_percent_when_the_measured_peak_read_low(monkeypatch):
    from llama_ddp.train import speed as metrics

    readings = iter([1e9, 2e9])  # start-up reading during a busy spell, then a second one
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda dtype: next(readings))
    peak = metrics.Peak(torch.device("cpu"), torch.float32, None, devices=1)
    assert peak.flops == 1e9
    assert peak.mfu(1e6, 4000.0) == 1.0  # 4 GFLOP/s achieved: above both readings
    assert peak.flops == 4e9  # never below what the run achieved
    assert peak.mfu(1e6, 2000.0) == pytest.approx(0.5)
    given = metrics.Peak(torch.device("cpu"), torch.float32, 0.001, devices=2)  # --peak-tflops
    assert given.flops == 2e9 and given.mfu(1e6, 1000.0) == pytest.approx(0.5)


def test_profile_steps_are_a_range_from_one():
    assert parse_steps("10:12") == (10, 12) and parse_steps("3:3") == (3, 3)
    for bad in ("12:10", "0:2", "3", "a:b", "1:2:3"):
        with pytest.raises(UserError, match="is not A:B with 1 <= A <= B"):
            parse_steps(bad)
    with pytest.raises(UserError, match="--profile-steps '5:1'"):
        parse_train_args(["--profile-steps", "5:1"])
    # A negative step is ours to refuse, not argparse's "expected one argument".
    for bad in ("-1:2", "-3:-1"):
        with pytest.raises(UserError, match=f"--profile-steps '{bad}' is not A:B"):
            parse_train_args(["--profile-steps", bad])


def test_a_range_that_starts_past_the_last_step_is_refused():
    """With --max-steps, before any data is read; with --epochs, once the data says how many
    steps (run.py calls the same check); a range that only ends past the end is accepted."""
    fix = "\\(profile steps up to 6, e.g. --profile-steps 5:6\\)"
    for steps in ("7:9", "7:7"):
        with pytest.raises(UserError, match=f"--profile-steps {steps} starts past the run's last "
                           f"step 6 {fix}"):  # fmt: skip
            parse_train_args(["--max-steps", "6", "--profile-steps", steps])
    cfg = parse_train_args(["--max-steps", "6", "--profile-steps", "5:100"])
    assert cfg.runtime.profile() == (5, 100)
    check_steps((6, 9), 6)
    check_steps(None, 1)
    with pytest.raises(UserError, match="starts past the run's last step 1 "):
        check_steps((2, 2), 1)


def test_a_range_past_the_end_is_written_at_the_end(tmp_path):
    """Steps 2:100 of a 3-step run: finish() (the trainer's, at the run's end) stops the
    profiler and writes steps 2-3; a second finish() does nothing."""
    profiler, said = StepProfiler((2, 100), tmp_path, torch.device("cpu"), enabled=True), []
    for step in (1, 2, 3):
        with profiler.step(step, said.append):
            torch.ones(4).sum()
    assert profiler.profiler is not None and not said  # still recording: the range goes on
    profiler.finish(said.append)
    profiler.finish(said.append)
    trace = tmp_path / PROFILE_DIR / "steps-2-3.pt.trace.json"
    assert profiler.profiler is None and said == [
        f"profile of steps 2-3: {trace} (ui.perfetto.dev)"
    ]
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("optimizer step")}
    assert steps == {"optimizer step 2", "optimizer step 3"}


def test_a_range_past_the_end_ends_the_process_cleanly(train_env, tmp_path):
    """The process that exited 139 (a segfault at exit, the profiler still running): exit 0,
    the trace of the steps it saw."""
    args = tiny_args(train_env, tmp_path, "--max-steps", "3", "--profile-steps", "2:100")
    result = run_train(train_env, [*args, "--save-every", "0", "--eval-every", "0"])
    assert result.returncode == 0, result.stderr[-2000:]
    trace = tmp_path / PROFILE_DIR / "steps-2-3.pt.trace.json"
    assert f"profile of steps 2-3: {trace}" in result.stdout
    assert json.loads(trace.read_text())["traceEvents"]


def test_a_run_writes_a_trace_of_the_profiled_steps(train_env, tmp_path, monkeypatch, capsys):
    """--profile-steps 2:3 of a 4-step run: one Chrome trace in OUT/profile/, valid JSON, with
    CPU events of steps 2 and 3 only (each a named range), and the run says where it is."""
    monkeypatch.setenv("LLAMA_DDP_CACHE", train_env["env"]["LLAMA_DDP_CACHE"])
    argv = tiny_args(train_env, tmp_path, "--max-steps", "4", "--profile-steps", "2:3")
    assert run(parse_train_args([*argv, "--cache-dir", str(train_env["root"] / "cache")])) == 0
    (trace,) = (tmp_path / PROFILE_DIR).iterdir()
    assert trace.name == "steps-2-3.pt.trace.json"
    events = json.loads(trace.read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("optimizer step")}
    assert steps == {"optimizer step 2", "optimizer step 3"}
    assert any(e.get("name", "").startswith("aten::") for e in events)  # the ops, on the CPU
    assert f"profile of steps 2-3: {trace}" in capsys.readouterr().out


def test_without_profile_steps_nothing_is_recorded(tmp_path):
    profiler = StepProfiler(None, tmp_path, torch.device("cpu"), enabled=True)
    with profiler.step(1, print):
        pass
    assert profiler.profiler is None and not (tmp_path / PROFILE_DIR).exists()
    assert not StepProfiler((1, 2), tmp_path, torch.device("cpu"), enabled=False).steps  # rank > 0


def test_a_cuda_out_of_memory_error_saves_a_snapshot_and_says_where(tmp_path, monkeypatch):
    """(CUDA mocked.) Profiling records the allocator's history from the start; the error names
    the snapshot it dumped, and without the history how to get one."""
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: 30 * 2**30)
    props = SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(("record", kw))
    )
    monkeypatch.setattr(
        torch.cuda.memory, "_dump_snapshot", lambda path: calls.append(("dump", path))
    )
    cuda = torch.device("cuda", 0)
    error = StepProfiler((1, 2), tmp_path, cuda, enabled=True).out_of_memory(7)
    snapshot = tmp_path / PROFILE_DIR / "oom-memory-snapshot.pickle"
    assert calls == [("record", {"max_entries": 200_000}), ("dump", str(snapshot))]
    assert str(error).startswith("CUDA out of memory in step 7 (peak 30.0 GiB allocated of 80.0)")
    assert f"memory snapshot: {snapshot} (open it at pytorch.org/memory_viz)" in str(error)
    assert str(error).endswith(
        "(lower --micro-batch-size, add --activation-checkpointing, or use --mode fsdp)"
    )
    monkeypatch.delenv("LLAMA_DDP_MEMORY_HISTORY", raising=False)
    quiet = StepProfiler(None, tmp_path, cuda, enabled=True).out_of_memory(7)
    assert "LLAMA_DDP_MEMORY_HISTORY=1 saves a memory snapshot" in str(quiet) and len(calls) == 2
