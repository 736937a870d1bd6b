"""train.py (its command line, its exit) on a slow disk: DCP's writer gets each tensor of a
checkpoint $SLOW_DISK_S seconds late, so that a checkpoint written in the background is in
flight for a known while and a signal lands inside it. A checkpoint thread still running when
the training loop ends, however it ends (`Trainer.fit` returns or raises), is named on stderr:
the process leaves soon after, and the interpreter's finalization under a thread inside torch's
code crashes (exit 134 or 139) or cuts its write short."""

import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from torch.distributed.checkpoint import DefaultSavePlanner  # noqa: E402

from llama_ddp.errors import exit_command  # noqa: E402
from llama_ddp.train.cli import main  # noqa: E402
from llama_ddp.train.trainer import Trainer  # noqa: E402

THREADS = ("llama_ddp-checkpoint", "llama_ddp-staging")

if __name__ == "__main__":
    delay = float(os.environ["SLOW_DISK_S"])
    resolve, fit = DefaultSavePlanner.resolve_data, Trainer.fit

    def slow(planner, write_item):
        time.sleep(delay)
        return resolve(planner, write_item)

    def checked_fit(trainer, *args, **kwargs):
        try:
            return fit(trainer, *args, **kwargs)
        finally:
            running = [t.name for t in threading.enumerate() if t.name.startswith(THREADS)]
            if running:
                print(f"still running when the loop ended: {', '.join(running)}", file=sys.stderr)

    DefaultSavePlanner.resolve_data, Trainer.fit = slow, checked_fit
    exit_command(main())
