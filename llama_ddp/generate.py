"""``python -m llama_ddp.generate``: the command lives in llama_ddp/generation/generate.py."""

import sys

from llama_ddp.generation.generate import main

if __name__ == "__main__":
    sys.exit(main())
