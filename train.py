"""Pretrain a Llama model. The same command runs on one device, with DataParallel, or with DDP:

python train.py --preset small
torchrun --standalone --nproc_per_node=4 train.py --preset base --dataset HuggingFaceFW/fineweb
"""

import sys

from llama_ddp.train.cli import main

if __name__ == "__main__":
    sys.exit(main())
