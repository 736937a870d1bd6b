"""``python -m llama_ddp.train``: train.py's command (train/cli.py), by the package's name."""

import sys

from llama_ddp.train.cli import main

sys.exit(main())
