"""Several train.py runs in one torchrun launch: each process calls train.py's `main` for one run
after the other, so that torchrun's start and rendezvous are paid once, not once per run
(`runs.runs_in_one_torchrun` starts it and reads what each run printed).

argv: a JSON file ``{"folder": ..., "runs": {name: [train.py's args]}}``. Each run joins a process
group of its own (a fresh namespace in torchrun's store, as a restarted worker's), and writes what
each rank printed to ``folder/<name>.rank<r>.stdout`` and ``.stderr``, and its exit code to
``.code``. A run that fails ends the launch: its peers may be waiting for it in a collective.
"""

import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llama_ddp.errors import exit_command  # noqa: E402
from llama_ddp.train.cli import main  # noqa: E402


def run_all(spec: dict) -> int:
    folder, rank = Path(spec["folder"]), os.environ["RANK"]
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    for name, argv in spec["runs"].items():
        os.environ["TORCHELASTIC_RESTART_COUNT"] = f"{restart}-{name}"  # its own namespace
        stem = folder / f"{name}.rank{rank}"
        with (
            open(f"{stem}.stdout", "w") as out,
            open(f"{stem}.stderr", "w") as err,
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
        ):
            try:
                code = main(argv)
            except BaseException:
                traceback.print_exc()
                code = 1
        Path(f"{stem}.code").write_text(str(code))
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    exit_command(run_all(json.loads(Path(sys.argv[1]).read_text())))
