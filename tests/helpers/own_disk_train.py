"""train.py as on nodes that each have their own --out-dir (a local disk, not a shared one): every
rank but 0 writes to $NODE_OUT_DIR instead, so one machine stands in for several."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from llama_ddp.train.cli import main  # noqa: E402

if __name__ == "__main__":
    argv = sys.argv[1:]
    if os.environ["RANK"] != "0":
        argv[argv.index("--out-dir") + 1] = os.environ["NODE_OUT_DIR"]
    sys.exit(main(argv))
