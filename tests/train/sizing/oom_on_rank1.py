"""train.py's main under torchrun with an out-of-memory injected on rank 1 only: every forward
of a model deeper than depth 1 raises torch.cuda.OutOfMemoryError there, and writes the marker
file named by the first argument (test_auto_timing.py; the other arguments are train.py's). The
candidates may take 60% of the time left, not 10%: d2 is timed on a slow machine too."""

import os
import sys
from pathlib import Path

import torch


def faulty(real, marker: Path):
    def loss(model, batch, precision):
        if getattr(model, "module", model).config.num_hidden_layers > 1:
            marker.write_text("raised")
            raise torch.cuda.OutOfMemoryError("injected on rank 1")
        return real(model, batch, precision)

    return loss


def main() -> None:
    marker, args = Path(sys.argv[1]), sys.argv[2:]
    from llama_ddp.train.sizing import auto

    auto.MEASURE_SHARE = 0.6  # time allowed for d2 however slow this machine is today
    if os.environ.get("RANK") == "1":
        from llama_ddp.train import trainer

        for module in (trainer, auto):
            if hasattr(module, "batch_loss_sum"):
                module.batch_loss_sum = faulty(module.batch_loss_sum, marker)
    from llama_ddp.errors import exit_command
    from llama_ddp.train.cli import main as train_main

    exit_command(train_main(args))


if __name__ == "__main__":
    main()
