"""The trained model's files: ``llama_model.pth`` (the plain state dict), ``llama_model.json`` (its
LlamaConfig), ``tokenizer.json`` and ``tokenizer_config.json`` (its roles), and loading a model
back for inference.

Every load goes through ``torch.load(weights_only=True)`` or safetensors: a file holding anything
but tensors and plain data is refused, and no code in it ever runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from llama_ddp import files, hub
from llama_ddp.errors import UserError
from llama_ddp.model import LlamaForPretraining
from llama_ddp.model_config import LlamaConfig
from llama_ddp.tokenizer import (
    TOKENIZER_CONFIG,
    TOKENIZER_FILE,
    read_tokenizer,
    tokenizer_config,
    tokenizer_file,
)

MODEL_FILE = "llama_model.pth"
CONFIG_FILE = "llama_model.json"


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Strip the prefixes DataParallel/DDP (``module.``) and torch.compile (``_orig_mod.``) add."""
    out = {}
    for name, tensor in state.items():
        for prefix in ("module.", "_orig_mod."):
            name = name.replace(prefix, "")
        out[name] = tensor
    return out


def save_model(
    model: torch.nn.Module | dict[str, torch.Tensor],
    config: LlamaConfig,
    out_dir: str | Path,
    tokenizer_path: str | Path | None = None,
) -> Path:
    """Write ``llama_model.pth`` (the plain state dict of ``model``, or ``model`` itself when it is
    a state dict), ``llama_model.json`` and, given a tokenizer (a tokenizer.json or its folder),
    ``tokenizer.json`` with its roles in ``tokenizer_config.json`` into ``out_dir``; each file is
    replaced atomically."""
    out_dir = Path(out_dir)
    state = model if isinstance(model, dict) else model.state_dict()
    state = {k: v.detach().cpu() for k, v in clean_state_dict(state).items()}
    needed = sum(t.numel() * t.element_size() for t in state.values())
    with files.writing(out_dir / MODEL_FILE, "model", needed):
        out_dir.mkdir(parents=True, exist_ok=True)
        files.torch_save(state, out_dir / MODEL_FILE)
        files.atomic_write(out_dir / CONFIG_FILE, config.save)
        if tokenizer_path is not None:
            source = tokenizer_file(tokenizer_path)
            _, special = read_tokenizer(source)
            if source.resolve() != (out_dir / TOKENIZER_FILE).resolve():
                files.copy_file(source, out_dir / TOKENIZER_FILE)
            text = json.dumps(tokenizer_config(special), indent=2) + "\n"
            files.write_text(out_dir / TOKENIZER_CONFIG, text)
    return out_dir / MODEL_FILE


def read_source(
    path: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """A model's shape and weights (for ``--init-from`` and inference): a Hugging Face Llama folder
    (config.json + safetensors, see ``hf.read_hf``), a ``llama_model.pth`` with its
    ``llama_model.json`` (unless ``config_path`` says otherwise), or a folder holding one."""
    from llama_ddp.hf import is_hf_folder, read_hf

    path = hub.local_path(path, hub.MODEL_FILES, "model")
    if path.is_file() and path.suffix in (".json", ".safetensors"):
        path = path.parent  # a file of a model folder (config.json, model.safetensors, ...)
    return read_hf(path) if is_hf_folder(path) else read_model(path, config_path)


def read_model(
    path: str | Path, config_path: str | Path | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """The config and state dict of a ``llama_model.pth`` (or a folder holding one); its config
    is the ``llama_model.json`` beside it unless ``config_path`` says otherwise."""
    path = Path(path)
    if path.is_dir():
        path = path / MODEL_FILE
    if not path.is_file():
        raise UserError(f"model {path} not found (train one with train.py, or check the path)")
    config = LlamaConfig.load(config_path or path.with_name(CONFIG_FILE))
    state = files.safe_load(path, "model", mmap=True)  # read where used: a rank its shards
    if not isinstance(state, dict):
        raise UserError(f"model {path} is not a state dict")
    return config, clean_state_dict(state)


def load_weights(model: LlamaForPretraining, state: dict[str, torch.Tensor], source: str) -> None:
    """Copy ``state`` into ``model``, every weight present and of its shape (a UserError naming
    ``source`` otherwise). Rotary tables a file lacks (a Hugging Face one has none) are the
    model's own: they are constants of its config."""
    tables = {n: b for n, b in model.named_buffers() if n.startswith("base_model.rotary_emb.")}
    try:
        model.load_state_dict({**tables, **state}, strict=True)
    except RuntimeError as exc:
        raise UserError(f"{source} does not match its config ({_first_mismatch(exc)})") from exc


def load_model(
    path: str | Path,
    *,
    config_path: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> LlamaForPretraining:
    """Load a trained model for inference.

    ``path`` is what ``read_source`` reads: a ``llama_model.pth`` (its ``llama_model.json`` is
    found beside it unless ``config_path`` says otherwise), a folder holding one, or a Hugging
    Face Llama folder (config.json + model.safetensors, or its shards), or a file of either.
    """
    source = f"model {path}" + (f" with config {config_path}" if config_path else "")
    config, state = read_source(path, config_path)
    model = LlamaForPretraining(config)
    load_weights(model, state, source)
    return model.to(device).eval()


def _first_mismatch(exc: RuntimeError) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0]


def run_summary(out_dir: Path, checkpoint: Path | None, hf: bool) -> str:
    """What a finished run wrote, and the next commands."""
    out = Path(out_dir)
    lines = [
        f"saved {out / MODEL_FILE} (with {CONFIG_FILE} and {TOKENIZER_FILE}: the model)",
        f"      {out / 'metrics.jsonl'} (the curves)",
    ]
    if hf:
        lines.append(f"      {out / 'hf'}/ (for transformers)")
    if checkpoint is not None:
        lines.append(f"      {checkpoint}/ (to resume, or to extend with a larger --max-steps)")
    lines += [
        "next:",
        f'  python -m llama_ddp.generate --model {out / MODEL_FILE} --prompt "..."',
        f"  python -m llama_ddp.plot {out / 'metrics.jsonl'}",
    ]
    if hf:
        lines.append(f'  transformers.AutoModelForCausalLM.from_pretrained("{out / "hf"}")')
    return "\n".join(lines)
