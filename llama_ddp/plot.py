"""``python -m llama_ddp.plot``: the command lives in llama_ddp/train/plot.py."""

import sys

from llama_ddp.train.plot import main

if __name__ == "__main__":
    sys.exit(main())
