"""Pretrain a Llama model. The same command runs on one device, with DataParallel, or with DDP:

python train.py --preset small
torchrun --standalone --nproc_per_node=4 train.py --preset base --dataset HuggingFaceFW/fineweb
"""

from llama_ddp.errors import exit_command
from llama_ddp.train.cli import main

if __name__ == "__main__":
    exit_command(main())
