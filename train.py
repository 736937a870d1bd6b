"""Pretrain a Llama model. The same command runs on one device, with DataParallel, or with DDP:

python train.py --preset small
torchrun --standalone --nproc_per_node=4 train.py --preset base --dataset HuggingFaceFW/fineweb
"""

if __name__ == "__main__":
    # Imported here: the token cache's builder and tokenizer processes, spawned, run this file
    # again (as __mp_main__) and need none of it (torch and the model: seconds each).
    try:
        from llama_ddp.errors import exit_command
    except ImportError as exc:  # a torch too old for llama_ddp: one line, not a traceback
        if not str(exc).startswith("llama_ddp needs torch"):
            raise
        import sys

        sys.exit(print(f"error: {exc}", file=sys.stderr) or 2)
    from llama_ddp.train.cli import main

    exit_command(main())
