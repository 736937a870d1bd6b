"""The token cache's builder process: `Builder` starts it (spawned) to run `shards.build` in the
background while training runs, `check` raises what stopped it, `stop` ends it with its workers.
It runs at a lower priority than training, ignores Ctrl-C (the run's to handle), and exits when
the run does, however the run ends.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import signal
import sys
import tempfile
import traceback
from pathlib import Path

from tokenizers import Tokenizer

from llama_ddp.data.cache.build import Job, build
from llama_ddp.data.cache.workers import exit_with_parent, lower_priority
from llama_ddp.data.tokenizer_files import SpecialIds
from llama_ddp.errors import UserError, WriteFailed


def default_num_proc() -> int:
    """All the cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def _builder_main(
    jobs: list[Job], tok_json: str, ids: SpecialIds, num_proc: int, parent: int, error_path: str
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the run's to handle
    signal.signal(signal.SIGTERM, _stop)  # `Builder.stop`: end the workers, then leave
    lower_priority()
    exit_with_parent(parent)
    try:
        build(jobs, tok_json, ids, num_proc)
    except _Stopped:
        return
    except BaseException as exc:  # every failure goes to the run, as one report
        kinds = {UserError: "user", WriteFailed: "write"}
        kind = next((v for k, v in kinds.items() if isinstance(exc, k)), "crash")
        text = "".join(traceback.format_exception(exc)) if kind == "crash" else str(exc)
        Path(error_path).write_text(f"{kind}\n{text}")
        sys.exit(2)
    finally:
        if os.getppid() != parent:  # the run is gone (killed): no one reads or removes the file
            Path(error_path).unlink(missing_ok=True)


class _Stopped(BaseException):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stopped


class Builder:
    """The background process that builds ``jobs``; `check` raises what stopped it, `stop`
    ends it (and its workers)."""

    def __init__(self, jobs: list[Job], tok: Tokenizer, ids: SpecialIds, num_proc: int) -> None:
        fd, self.error_path = tempfile.mkstemp(prefix="llama_ddp-builder-", suffix=".txt")
        os.close(fd)
        ctx = multiprocessing.get_context("spawn")
        args = (jobs, tok.to_str(), ids, num_proc, os.getpid(), self.error_path)
        self.process = ctx.Process(target=_builder_main, args=args, name="llama_ddp-builder")
        self.process.start()
        atexit.register(self.stop)

    @property
    def running(self) -> bool:
        return self.process.exitcode is None

    def check(self) -> None:
        code = self.process.exitcode
        if code in (None, 0):
            return
        kind, _, text = Path(self.error_path).read_text().partition("\n")
        if kind == "user":
            raise UserError(text)
        if kind == "write":
            raise WriteFailed(text)
        raise RuntimeError(f"the token cache builder failed (exit {code}):\n{text}")

    def stop(self) -> None:
        """End the builder now (what it built stays; a later run builds the rest)."""
        atexit.unregister(self.stop)
        if self.process.exitcode is None:
            self.process.terminate()
            self.process.join(10)
            if self.process.exitcode is None:
                self.process.kill()
                self.process.join()
        Path(self.error_path).unlink(missing_ok=True)
