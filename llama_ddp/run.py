"""A training run from its config: the builders in order, the run folder, the process group.

run(cfg)  # what train.py does after parsing its flags
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch

from llama_ddp import checkpoint as ckpt
from llama_ddp import distributed as D
from llama_ddp import files
from llama_ddp.config import TrainConfig
from llama_ddp.data import build_data
from llama_ddp.evaluate import TaskEvaluator
from llama_ddp.export import load_weights, read_source
from llama_ddp.model_config import LlamaConfig
from llama_ddp.optim import build_optimizer
from llama_ddp.parallelize import build_model, parallelize
from llama_ddp.precision import Precision, allow_tf32, resolve_dtype
from llama_ddp.preemption import Preemption
from llama_ddp.tasks import load_tasks
from llama_ddp.trainer import FaultHook, Trainer


def resume_point(cfg: TrainConfig, rt: D.Runtime) -> Path | None:
    """The checkpoint this run continues from (``--resume``; rank 0 decides), or None."""
    path = ckpt.find_resume(cfg.out_dir, cfg.resume) if rt.is_main else None
    path = D.broadcast_object(path, rt)
    return None if path is None else Path(path)


def initial_weights(
    cfg: TrainConfig, resume: Path | None
) -> tuple[LlamaConfig | None, dict[str, torch.Tensor] | None]:
    """--init-from's shape and weights. A run that resumes a checkpoint takes the shape the
    checkpoint was trained with and no weights: it needs no source (which may be gone)."""
    if not cfg.init_from:
        return None, None
    if resume is not None:
        return LlamaConfig.from_dict(ckpt.saved_setting(resume, "model_shape")), None
    return read_source(cfg.init_from)


def build_trainer(
    cfg: TrainConfig,
    rt: D.Runtime,
    *,
    fault: FaultHook | None = None,
    resume: Path | None = None,
) -> Trainer:
    """data -> model (with --init-from's weights) -> parallelized model -> optimizer -> Trainer,
    for this rank (``resume``: the checkpoint it will continue from, see ``resume_point``)."""
    source_config, weights = initial_weights(cfg, resume)
    if source_config is not None:
        cfg.check_source(source_config)  # before any data is read
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
    tasks = load_tasks(cfg.task_specs(), cfg.eval_limit, cache_dir)  # bad lines: before the data
    data = build_data(cfg, rt)
    precision = Precision(resolve_dtype(cfg.dtype, rt.device), rt.device)
    allow_tf32(rt.device)
    model = build_model(cfg.model_config(data.vocab_size, source_config), cfg.seed, rt.device)
    if weights is not None:
        # Full weights into the plain model, before any wrapper: the same in every mode.
        load_weights(model, weights, f"--init-from {cfg.init_from}")
    train_model = parallelize(model, rt, cfg, precision)
    optimizer = build_optimizer(
        model, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(cfg.beta1, cfg.beta2)
    )
    evaluator = None
    if tasks:
        budget = cfg.micro_batch(rt.world_size) * cfg.seq_length  # a training micro-batch's tokens
        evaluator = TaskEvaluator(tasks, data.tokenizer, data.special.ids.bot, budget)
    return Trainer(
        cfg, rt, data, model, train_model, optimizer, precision, fault=fault, tasks=evaluator
    )


@contextlib.contextmanager
def run_folder(out_dir: str | Path, rt: D.Runtime) -> Iterator[None]:
    """Rank 0 owns the run folder for the block: created, locked against a second run, and rid
    of what a killed run left half-written."""
    if not rt.is_main:
        yield
        return
    out = files.prepare_run_dir(out_dir)
    with files.run_lock(out):
        for path in files.remove_temporaries(out):
            print(f"removed {path}, left half-written by a run that was killed", flush=True)
        yield


def run(cfg: TrainConfig, *, fault: FaultHook | None = None) -> int:
    """Train as ``cfg`` says in this process: 0 when done, else the signal that stopped it."""
    with Preemption() as preemption:
        rt = D.setup(cfg.mode, cfg.device)
        try:
            with run_folder(cfg.out_dir, rt):
                resume = resume_point(cfg, rt)
                trainer = build_trainer(cfg, rt, fault=fault, resume=resume)
                trainer.resume(resume)
                preemption.training()
                return trainer.fit(preemption)
        finally:
            D.teardown(rt)
