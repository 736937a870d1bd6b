"""The tests' forked launches (tests/helpers/runs.py) behave as the commands they stand for: a
torchrun worker forked from its agent starts as the torchrun command's new interpreter would (its
signals' default actions, unbuffered output, its exit code reported), and a `Forked` process is
waited for with every process it started, as ``subprocess.run`` waits for its pipes' holders."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.leftovers import alive
from tests.helpers.runs import Forked, run_torchrun

WORKER = """
import os, signal, sys
print("SIGTERM default", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
print("SIGINT raises", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
print("argv", sys.argv[1:])
sys.stdout.write("written, not flushed")
os._exit(3)
"""


def test_a_forked_torchrun_worker_starts_as_a_new_interpreter_and_its_exit_is_reported(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    flags = ["--standalone", "--nproc_per_node=1", "--max-restarts=0"]
    run = run_torchrun({"env": env}, flags, [str(script), "--flag", "x"], timeout=120)
    assert "SIGTERM default True" in run.stdout  # not elastic's handler, which raises
    assert "SIGINT raises True" in run.stdout
    assert "argv ['--flag', 'x']" in run.stdout
    assert "written, not flushed" in run.stdout  # python -u, as the torchrun command's workers
    assert run.returncode == 1, run.stderr[-2000:]
    assert "exitcode: 3" in run.stderr


def _start_a_child_and_return(args: list[str]) -> int:
    child = subprocess.Popen(["sleep", "60"])
    Path(args[0]).write_text(str(child.pid))
    return 0


def _exit_with_text(args: list[str]) -> int:
    sys.exit("a message")


def _exit_with_none(args: list[str]) -> int:
    sys.exit(None)


def test_forked_waits_for_the_processes_it_started_and_kill_stops_them(tmp_path):
    pid_file = tmp_path / "child.pid"
    proc = Forked(_start_a_child_and_return, [str(pid_file)], dict(os.environ))
    with pytest.raises(subprocess.TimeoutExpired):
        proc.communicate(timeout=3)  # its child still holds what it printed to
    assert proc.returncode == 0
    child = int(pid_file.read_text())
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(child)


def test_forked_gives_sys_exits_code_and_text_as_an_interpreter_does():
    proc = Forked(_exit_with_text, [], dict(os.environ))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert err.strip() == "a message"
    proc = Forked(_exit_with_none, [], dict(os.environ))
    proc.communicate(timeout=60)
    assert proc.returncode == 0
    proc.send_signal(signal.SIGTERM)  # ended: nothing is signalled (its PID may be reused)
