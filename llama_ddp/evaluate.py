"""``python -m llama_ddp.evaluate``: the command lives in llama_ddp/eval/scoring.py."""

import sys

from llama_ddp.eval.scoring import main

if __name__ == "__main__":
    sys.exit(main())
