"""Reading a model's shape and weights from any source into our class: a ``llama_model.pth`` with
its ``llama_model.json``, a Hugging Face Llama folder (hf.py), or a GGUF file (gguf_source.py).
The writers are export.py (ours) and hf.py (Hugging Face's).

Every load goes through ``torch.load(weights_only=True)``, safetensors or GGUF: a file holding
anything but tensors and plain data is refused, and no code in it ever runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from llama_ddp import hub, safe_io
from llama_ddp.errors import UserError
from llama_ddp.gguf_source import is_gguf, read_gguf_config, read_gguf_weights
from llama_ddp.hf import from_hf_state_dict, hf_llama_config, is_hf_folder, read_hf
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import LlamaConfig

MODEL_FILE = "llama_model.pth"
CONFIG_FILE = "llama_model.json"
EMBEDDING, HEAD = "base_model.embed_tokens.weight", "lm_head.weight"


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the prefixes DataParallel/DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    out = {}
    for name, tensor in state.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.replace(prefix, "")
        out[name] = tensor
    return out


def read_source(
    path: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A model's shape and weights (for ``--init-from`` and inference): a Hugging Face Llama folder
    (config.json + safetensors, see ``hf.read_hf``), a GGUF file (dequantized to fp32), a
    ``llama_model.pth`` with its ``llama_model.json`` (unless ``config_path`` says otherwise), or a
    folder holding one. A tied source's state names both the embedding and the lm_head."""
    path = hub.local_path(path, hub.MODEL_FILES, "model")
    if is_gguf(path):
        return read_gguf(path)
    if path.is_file() and path.suffix in (".json", ".safetensors"):
        path = path.parent  # a file of a model folder (config.json, model.safetensors, ...)
    return read_hf(path) if is_hf_folder(path) else read_model(path, config_path)


def read_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A GGUF file's shape (refused unless it is a plain Llama, before any tensor is read) and its
    weights, dequantized to fp32 by transformers' loader."""
    config = hf_llama_config(read_gguf_config(path), path)
    state = from_hf_state_dict(read_gguf_weights(path))
    return config, {k: v for k, v in state.items() if "rotary_emb" not in k}


def read_model(
    path: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and state dict of a ``llama_model.pth`` (or a folder holding one); its config
    is the ``llama_model.json`` beside it unless ``config_path`` says otherwise."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise UserError(
            f"model {path} not found (train one with train.py, or give a Hugging Face Llama "
            "folder, a .gguf file, or check the path)"
        )
    config = LlamaConfig.load(config_path or path.with_name(CONFIG_FILE))
    state = safe_io.safe_load(path, "model", mmap=True)  # read where used: a rank its shards
    if not isinstance(state, dict):
        raise UserError(f"model {path} is not a state dict")
    return config, clean_state_dict(state)


def load_weights(model: LlamaForPretraining, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model``, every weight present and of its shape (a UserError naming
    ``source`` otherwise). Rotary tables a file lacks (a Hugging Face one has none) are the
    model's own: they are constants of its config. A tied model's lm_head is its embedding: a
    state whose two differ is refused (it was trained untied), one without an lm_head gets it."""
    tables = {n: b for n, b in model.named_buffers() if n.startswith("base_model.rotary_emb.")}
    if model.config.tie_word_embeddings and EMBEDDING in state:
        state = {**tied_weights(model.config, state, source), HEAD: state[EMBEDDING]}
    try:
        model.load_state_dict({**tables, **state}, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{source} does not match its config ({_first_mismatch(exc)})") from exc


def tied_weights(
    config: LlamaConfig, weights: Mapping[str, torch.Tensor], source: str
) -> Mapping[str, torch.Tensor]:
    """``weights`` for a model of ``config``: a tied model's lm_head is its embedding, so its
    lm_head entry is dropped, and a state whose lm_head differs from its embedding (trained
    untied) is refused."""
    if not config.tie_word_embeddings or HEAD not in weights:
        return weights
    head, embedding = weights[HEAD], weights.get(EMBEDDING)
    if embedding is not None and head.shape == embedding.shape and not torch.equal(head, embedding):
        raise UserError(
            f"{source} has an lm_head other than its embedding, but its config ties them "
            "(give the config it was trained with)"
        )
    return {name: value for name, value in weights.items() if name != HEAD}


def load_model(
    path: str | Path,
    *,
    config_path: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> LlamaForPretraining:
    """Load a model for inference from anything ``read_source`` reads: a ``llama_model.pth`` (its
    ``llama_model.json`` is found beside it unless ``config_path`` says otherwise), a folder
    holding one, a Hugging Face Llama folder (config.json + model.safetensors, or its shards) or a
    file of one, or a GGUF file."""
    source = f"model {path}" + (f" with config {config_path}" if config_path else "")
    config, state = read_source(path, config_path)
    model = LlamaForPretraining(config)
    load_weights(model, state, source)
    return model.to(device).eval()


def parameter_count(config: LlamaConfig) -> int:
    """The parameters of a model of this shape (a tied one counts its embedding once), without
    allocating it."""
    with torch.device("meta"):
        return LlamaForPretraining(config).num_parameters()


def _first_mismatch(exc: RuntimeError) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0]
