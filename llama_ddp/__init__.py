"""llama_ddp: a small, fast, correct Llama pretraining application."""

from llama_ddp.checkpoint import load_model, save_model
from llama_ddp.config import PRESETS, LlamaConfig, preset
from llama_ddp.errors import UserError
from llama_ddp.model import KVCache, LlamaForPretraining, LlamaModel, flops_per_token

__all__ = [
    "PRESETS",
    "KVCache",
    "LlamaConfig",
    "LlamaForPretraining",
    "LlamaModel",
    "UserError",
    "flops_per_token",
    "load_model",
    "save_model",
    "preset",
]
__version__ = "0.1.0"
