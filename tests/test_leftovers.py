"""The suite's own safety: a pytest-xdist worker that dies in a test leaves no process of its
tests running (tests/helpers/leftovers.py, conftest's `pytest_testnodedown`)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.leftovers import alive, carrying, stop_carrying

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(300)"]


def test_only_the_processes_that_carry_the_marks_are_stopped():
    marked = subprocess.Popen(SLEEPER, env={**os.environ, "LLAMA_DDP_TEST_MARK": "a"})
    other = subprocess.Popen(SLEEPER, env={**os.environ, "LLAMA_DDP_TEST_MARK": "ab"})
    try:
        time.sleep(0.2)  # both have exec'd: their environment is the one given
        assert carrying({"LLAMA_DDP_TEST_MARK": "a"}) == [marked.pid]
        assert stop_carrying({"LLAMA_DDP_TEST_MARK": "a"}) == [marked.pid]
        assert marked.wait(10) == -signal.SIGKILL
        assert other.poll() is None and carrying({"LLAMA_DDP_TEST_MARK": "a"}) == []
    finally:
        for proc in (marked, other):
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("end", ["exit", "timeout"])
def test_a_worker_that_dies_in_a_test_leaves_nothing_running(end, tmp_path):
    """A worker ended in its test while that test's command runs, by os._exit (as an
    out-of-memory kill leaves it) or by pytest-timeout past the project's limit (its "thread"
    method, pyproject.toml's, here at 2 s): the command is stopped as the controller sees the
    worker down. Without the hook it sleeps on for 300 s."""
    pid_file = tmp_path / "pid"
    (tmp_path / "test_dies.py").write_text(
        "import os, subprocess, sys, time\n"
        "def test_dies():\n"
        f"    proc = subprocess.Popen({SLEEPER!r})\n"
        f"    open({str(pid_file)!r}, 'w').write(str(proc.pid))\n"
        + ("    os._exit(1)\n" if end == "exit" else "    time.sleep(60)\n")
    )
    ini = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert ini["timeout_method"] == "thread" and 300 < ini["timeout"] <= 900
    cmd = [sys.executable, "-m", "pytest", "-q", "-c", os.devnull, "-p", "no:cacheprovider"]
    cmd += ["-p", "tests.helpers.leftovers", "-n", "1", "--max-worker-restart", "0"]
    cmd += ["-o", "timeout=2", "-o", f"timeout_method={ini['timeout_method']}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    start = time.monotonic()
    done = subprocess.run([*cmd, "test_dies.py"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    elapsed, pid = time.monotonic() - start, int(pid_file.read_text())
    try:
        assert done.returncode == 1, done.stdout + done.stderr
        assert "worker 'gw0' crashed while running 'test_dies.py::test_dies'" in done.stdout
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
        assert f"[gw0] stopped the processes its tests left running: [{pid}]" in done.stdout
        assert elapsed < 40  # the timeout's test ended at 2 s of its 60 s sleep
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
