"""``python -m llama_ddp.plot``: the command lives in llama_ddp/train/metrics.py."""

import sys

from llama_ddp.train.metrics import plot_main as main

if __name__ == "__main__":
    sys.exit(main())
