"""A worker of `runs.run_torchrun`'s launch (torchrun's ``--run-path --start-method fork``): runs
the script in argv[1] with the rest of argv as ``python <script> <args>`` would, in this process
forked from torchrun's agent. The exit handlers it inherited from the agent are not its own and
are dropped; the ones its script registers run at its end, as at an interpreter's exit (a
forked process ends without them)."""

import atexit
import runpy
import sys

if __name__ == "__main__":
    atexit._clear()
    sys.argv = sys.argv[1:]
    try:
        runpy.run_path(sys.argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()
