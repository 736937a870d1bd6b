"""profiling.py: --profile-steps writes a trace of those steps; a CUDA out-of-memory error is one
line, with the memory snapshot it saved."""

import json

import pytest
import torch

from llama_ddp.errors import UserError
from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.profiling import PROFILE_DIR, StepProfiler, parse_steps
from llama_ddp.train.run import run
from tests.helpers.runs import tiny_args


def test_profile_steps_are_a_range_from_one():
    assert parse_steps("10:12") == (10, 12) and parse_steps("3:3") == (3, 3)
    for bad in ("12:10", "0:2", "3", "a:b", "1:2:3"):
        with pytest.raises(UserError, match="is not A:B with 1 <= A <= B"):
            parse_steps(bad)
    with pytest.raises(UserError, match="--profile-steps '5:1'"):
        parse_train_args(["--profile-steps", "5:1"])


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
