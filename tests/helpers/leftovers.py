"""The processes a pytest-xdist worker's tests started, found by the environment they inherited
(``PYTEST_XDIST_WORKER`` and ``PYTEST_XDIST_TESTRUNUID``, which xdist puts in the worker's
environment at its start; every command a test starts, each fork server and what it forks
carries them), so that the session stops them once the worker is gone (`pytest_testnodedown`,
conftest's): a worker killed in a test (an out-of-memory kill, a crash, pytest-timeout's exit)
would otherwise leave its torchrun of 100000 steps taking the cores from every later test."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

import pytest


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command's name (state, parent, process group, ...);
    None where the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has left: its parent has yet to reap it)."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def carrying(marks: dict[str, str]) -> list[int]:
    """The PIDs of the live processes whose environment holds every one of ``marks``
    (NAME=value), this process excluded."""
    wanted = {f"{k}={v}".encode() for k, v in marks.items()}
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        pid = int(proc.name)
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if wanted <= set((proc / "environ").read_bytes().split(b"\0")) and alive(pid):
                found.append(pid)
    return found


def stop_carrying(marks: dict[str, str]) -> list[int]:
    """SIGKILL to every process `carrying` ``marks``; their PIDs."""
    pids = carrying(marks)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    return pids


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """pytest-xdist's, in the controller, as a worker leaves: the processes its tests started
    and left are stopped; the line names them where the worker died."""
    worker, run = node.workerinput["workerid"], node.workerinput["testrunuid"]
    stopped = stop_carrying({"PYTEST_XDIST_WORKER": worker, "PYTEST_XDIST_TESTRUNUID": run})
    if error and stopped:
        print(f"\n[{worker}] stopped the processes its tests left running: {stopped}")
