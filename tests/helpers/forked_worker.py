"""A worker of `runs.run_torchrun`'s launch (torchrun's ``--run-path --start-method fork``): runs
the script in argv[1] with the rest of argv as ``python -u <script> <args>`` would (the torchrun
command's worker), in this process forked from torchrun's agent. What it inherited from the agent
and a new interpreter would not have is put back first: the agent's exit handlers (dropped; the
script's own run at its end, as at an interpreter's exit, which a forked process skips), its
signal handlers (elastic's, which raise SignalException: SIGTERM, SIGHUP and SIGQUIT end the
process again, SIGINT raises KeyboardInterrupt) and block-buffered output (``-u``: what the
script prints reaches its file before a SIGKILL or an ``os._exit``)."""

import atexit
import io
import runpy
import signal
import sys

if __name__ == "__main__":
    atexit._clear()
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout, sys.stderr = (
        io.TextIOWrapper(io.FileIO(fd, "w", closefd=False), write_through=True) for fd in (1, 2)
    )
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()
