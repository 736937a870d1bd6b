"""scripts/slurm/train.sbatch, checked as far as a script can be without SLURM: its syntax, its
directives, the torchrun command it builds, and what it does on SIGTERM (fake srun and scontrol
on PATH record what they are asked)."""

import os
import signal
import subprocess
import sys
import time

import pytest
from torch.distributed.run import get_args_parser

from llama_ddp.train.cli import build_parser
from tests.helpers.runs import ROOT

SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"
FAKE_SRUN = """#!/bin/bash
printf '%s\\n' "$@" > "$LOG/srun.args"
if [ -n "${SRUN_WAITS:-}" ]; then
    trap 'sleep 0.5; echo "srun: saved after SIGTERM" >> "$LOG/events"; exit 143' TERM
    while :; do sleep 0.05; done
fi
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") printf 'gpu07\\ngpu08\\n' ;;
    *) echo "scontrol $*" >> "$LOG/events" ;;
esac
"""


def test_the_script_is_valid_bash_with_its_directives_first():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    lines = SCRIPT.read_text().splitlines()
    header = lines[: next(i for i, line in enumerate(lines) if line and line[0] != "#")]
    directives = [line.split()[1] for line in header if line.startswith("#SBATCH")]
    # sbatch reads #SBATCH lines only above the first command: all of them must be there.
    assert len(directives) == sum(line.startswith("#SBATCH") for line in lines)
    assert {"--signal=B:TERM@120", "--requeue", "--ntasks-per-node=1"} <= set(directives)


@pytest.fixture
def fake_slurm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "PYTHON": sys.executable,  # the torch whose torchrun the script asks what it takes
        "LOG": str(tmp_path),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "gpu[07-08]",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_GPUS_ON_NODE": "4",
        "SLURM_CPUS_PER_TASK": "16",
    }
    return tmp_path, env


TRAIN_ARGS = ["--preset", "base", "--out-dir", "/shared/runs/base"]


def test_it_starts_one_torchrun_per_node_meeting_on_the_first_node(fake_slurm):
    log, env = fake_slurm
    result = subprocess.run(
        ["bash", str(SCRIPT), *TRAIN_ARGS], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    srun_args = (log / "srun.args").read_text().splitlines()
    assert srun_args[:6] == [
        "--ntasks-per-node=1", "--cpus-per-task=16", "--kill-on-bad-exit=1",
        sys.executable, "-m", "torch.distributed.run",
    ]  # fmt: skip
    torchrun = get_args_parser().parse_args(srun_args[6:])  # torchrun's own parser reads it
    assert (torchrun.nnodes, torchrun.nproc_per_node) == ("2", "4")
    assert (torchrun.rdzv_backend, torchrun.rdzv_endpoint) == ("c10d", "gpu07:29500")
    assert (torchrun.rdzv_id, torchrun.max_restarts) == ("4242", 3)
    # torch 2.13's torchrun takes the grace; 2.9's has no such flag (a fixed 30 s)
    assert getattr(torchrun, "shutdown_timeout", 100) == 100
    assert torchrun.training_script == "train.py"
    assert torchrun.training_script_args == TRAIN_ARGS
    build_parser().parse_args(torchrun.training_script_args)  # flags train.py knows
    assert not (log / "events").exists()  # a finished job is not requeued


def test_sigterm_reaches_srun_and_requeues_the_job_once_it_has_saved(fake_slurm):
    log, env = fake_slurm
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *TRAIN_ARGS],
        env={**env, "SRUN_WAITS": "1"},
        cwd=ROOT,
        start_new_session=True,  # a group of its own, as a job has: nothing in it may outlive it
    )
    try:
        deadline = time.monotonic() + 30
        while not (log / "srun.args").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # --signal=B:TERM: the batch shell alone
        assert proc.wait(timeout=30) == 143  # srun's status: the run stopped after its save
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    events = (log / "events").read_text().splitlines()
    assert events == ["srun: saved after SIGTERM", "scontrol requeue 4242"]  # in this order
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)  # any process left in the job's group?
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("a process of the script outlived it")
