"""The exceptions the command line maps to exit codes (cli.py).

UserError is a mistake a user can fix: one line ``error: <what> (<how to fix>)``, exit code 2.
NonFiniteLoss stops a diverging run before it writes anything newer than its last good checkpoint
(exit code 1). Everything else is a failure nothing could have prevented (exit code 1).
"""

import argparse
from typing import NoReturn


class UserError(Exception):
    """A mistake the user can fix: bad flag, missing file, wrong column, bad shape."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes (an unknown flag, a bad value) are a UserError naming the
    command's --help, for every command line of the project."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see {self.prog} --help)")


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
    nodes): exit code 1 with one line naming the path and what to do; the failed write removed
    its temporaries, and every file written before it is intact."""
