"""``python -m llama_ddp.export``: the command lives in llama_ddp/interop/export.py."""

import sys

from llama_ddp.interop.export import main

if __name__ == "__main__":
    sys.exit(main())
