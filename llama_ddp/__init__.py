"""llama_ddp: a small, fast, correct Llama pretraining application.

The names below are imported on first use: a process that needs one module (the token cache's
builder and tokenizer workers, ``python -m llama_ddp.generate``) does not import torch and the
model with the package.
"""

import importlib

_WHERE = {
    "UserError": "llama_ddp.errors",
    "load_model": "llama_ddp.interop.load",
    "save_model": "llama_ddp.interop.native",
    "KVCache": "llama_ddp.model.llama",
    "LlamaForPretraining": "llama_ddp.model.llama",
    "LlamaModel": "llama_ddp.model.llama",
    "flops_per_token": "llama_ddp.model.llama",
    "PRESETS": "llama_ddp.model.config",
    "LlamaConfig": "llama_ddp.model.config",
    "preset": "llama_ddp.model.config",
    "load_tokenizer": "llama_ddp.data.tokenizer_files",
    "generate_text": "llama_ddp.generation.generate",
}
__all__ = sorted(_WHERE)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'llama_ddp' has no attribute {name!r}")
