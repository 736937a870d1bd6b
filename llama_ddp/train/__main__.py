"""``python -m llama_ddp.train``: train.py's command (train/cli.py), by the package's name."""

from llama_ddp.errors import exit_command
from llama_ddp.train.cli import main

exit_command(main())
