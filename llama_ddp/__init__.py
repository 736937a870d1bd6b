"""llama_ddp: a small, fast, correct Llama pretraining application."""

from llama_ddp.errors import UserError
from llama_ddp.export import save_model
from llama_ddp.model import KVCache, LlamaForPretraining, LlamaModel, flops_per_token
from llama_ddp.model_config import PRESETS, LlamaConfig, preset
from llama_ddp.tokenizer import load_tokenizer
from llama_ddp.weights import load_model

__all__ = [
    "PRESETS",
    "KVCache",
    "LlamaConfig",
    "LlamaForPretraining",
    "LlamaModel",
    "UserError",
    "flops_per_token",
    "generate_text",
    "load_model",
    "load_tokenizer",
    "save_model",
    "preset",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    # Imported on first use: `python -m llama_ddp.generate` must not find it already imported.
    if name == "generate_text":
        from llama_ddp.generate import generate_text

        return generate_text
    raise AttributeError(f"module 'llama_ddp' has no attribute {name!r}")
