"""The exceptions every command line maps to exit codes, and the one function that does it
(`run_command`: train.py, generate, evaluate, plot, export, plan); `exit_command` ends a command's
process.

UserError is a mistake a user can fix: one line ``error: <what> (<how to fix>)``, exit code 2.
NonFiniteLoss stops a diverging run before it writes anything newer than its last good checkpoint
(exit code 1). Everything else is a failure nothing could have prevented (exit code 1).
"""

import argparse
import gc
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix: bad flag, missing file, wrong column, bad shape."""


# How a negative value begins (``-1``, ``-.5``), which argparse would read as a flag.
NEGATIVE_STARTS = {f"-{c}" for c in "0123456789."}


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes (an unknown flag, a bad value) are a UserError naming the
    command's --help, for every command line of the project."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        """argparse's, except that a value starting with a minus (``--profile-steps -1:2``,
        ``--lr -1e-3``) is the flag's value, checked and refused in our own words, not a flag
        argparse does not know."""
        args = list(sys.argv[1:] if args is None else args)
        takes_one = {
            s
            for a in self._actions
            if a.nargs is None and a.option_strings
            for s in a.option_strings
        }
        joined: list[str] = []
        for arg in args:
            if joined and joined[-1] in takes_one and arg[:2] in NEGATIVE_STARTS:
                joined[-1] = f"{joined[-1]}={arg}"
            else:
                joined.append(arg)
        return super().parse_known_args(joined, namespace)


class NonFiniteLoss(RuntimeError):
    """The loss or the gradient norm is not finite: training cannot go on from here."""


class DataWaitTimeout(RuntimeError):
    """A rank of a job across machines waited for its data (the token cache its machine builds)
    nearly as long as its peers' collectives wait for it: exit code 1 with one line from that
    rank, not a collective timeout that names no cause."""


class Interrupted(Exception):
    """A signal stopped the run where no checkpoint is due (preparation, or a person's second
    Ctrl-C): exit code 128 + ``signum``, no traceback, nothing half-written left behind."""

    def __init__(self, signum: int, detail: str) -> None:
        super().__init__(f"stopped by signal {signum} {detail}")
        self.signum = signum


class WriteFailed(Exception):
    """The disk refused a write (full, over quota or a file size limit, read-only, I/O error), or
    rank 0 cannot see the checkpoint shards other ranks wrote (an --out-dir not shared by all
    nodes): exit code 2 with one line naming the path and what to do (free space, lift the limit,
    share the folder: the user's to fix, like a UserError); the failed write removed its
    temporaries, and every file written before it is intact."""


def run_command(body: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a command line's ``body(argv)`` and say how it ended, the same for every command: a
    UserError or a refused write is one ``error:`` line and exit 2 (``--debug`` in argv: a
    UserError's traceback instead); a non-finite loss, one line and exit 1; a signal, 128 + its
    number; Ctrl-C outside a run, 130; a reader that left (``| head``), a quiet exit 1. Under
    torchrun only rank 0 speaks. Anything else is a failure nothing could have prevented: its
    traceback, exit 1."""
    argv = list(sys.argv[1:] if argv is None else argv)
    speaks = os.environ.get("RANK", "0") == "0"

    def say(text: str) -> None:
        if speaks:
            print(text, file=sys.stderr)

    try:
        return body(argv) or 0
    except UserError as exc:
        if "--debug" in argv:
            raise
        say(f"error: {exc}")
        return 2
    except WriteFailed as exc:
        say(f"error: {exc}")
        return 2
    except NonFiniteLoss as exc:
        say(f"error: {exc}")
        return 1
    except DataWaitTimeout as exc:  # the rank that waited says so, whichever it is
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Interrupted as exc:  # a signal before training started, or a second Ctrl-C
        say(str(exc))
        return 128 + exc.signum
    except KeyboardInterrupt:
        say("")
        return 130
    except BrokenPipeError:
        # The reader left (`| head`): stop quietly, and keep Python's exit flush from failing too.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def exit_command(code: int) -> NoReturn:
    """End a command's process with its exit ``code`` once the command returned (its files
    closed, its work joined): the objects it made, torch's and its peers' among them, are frozen
    and left to the operating system, not walked by Python's last garbage collections (about 2 s
    at every exit). Exit handlers (atexit) still run."""
    gc.freeze()
    sys.exit(code)
