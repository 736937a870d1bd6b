"""A training run from its config: the builders in order, resuming, the run folder, the export.

run(cfg)  # what train.py does after parsing its flags
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from llama_ddp.checkpoint import state as ckpt
from llama_ddp.checkpoint.manager import Checkpointer, remove_shard_leftovers
from llama_ddp.data.cache.read import Patience
from llama_ddp.data.pipeline import TrainData, build_data
from llama_ddp.data.tokenizer_files import write_tokenizer_files
from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.memory import fit_micro_batch, wants_auto
from llama_ddp.distributed.parallelize import (
    Init,
    empty_model,
    is_sharded,
    parallelize,
    replica_mesh,
    runtime,
)
from llama_ddp.errors import UserError
from llama_ddp.eval.scoring import TaskEvaluator
from llama_ddp.eval.tasks import load_tasks
from llama_ddp.files import safe_io
from llama_ddp.files.preparation import Preparation
from llama_ddp.interop.export import export_run
from llama_ddp.interop.gguf_export import check_tokenizer
from llama_ddp.interop.load import read_source
from llama_ddp.interop.native import run_summary
from llama_ddp.model import kernel_choice
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.weights import parameter_count
from llama_ddp.precision import Precision, allow_tf32, emulation_warning, training_dtype
from llama_ddp.train.config import TrainConfig
from llama_ddp.train.metrics import Reporter
from llama_ddp.train.optim import PROVISIONAL_STEPS, Schedule, ScheduleState, build_schedule
from llama_ddp.train.preemption import Preemption, grace_seconds, save_time_note, slow_save_warning
from llama_ddp.train.sizing.auto import choose_size
from llama_ddp.train.speed import StepProfiler, check_steps, process_age, time_line
from llama_ddp.train.trainer import FaultHook, Trainer, TrainState, no_fault
from llama_ddp.train.validation import Evaluator


def run_data(cfg: TrainConfig, rt: D.Runtime) -> TrainData:
    """The run's data for this rank: the machine's local rank 0 prepares the files every process
    reads (tokenizer, token cache) while the others wait at the CPU group's barrier."""
    prep = Preparation(rt.local_rank == 0, functools.partial(D.preparation_barrier, rt))
    return build_data(
        cfg.data, seed=cfg.runtime.seed, sized=cfg.schedule.sized(), rank=rt.rank,
        world_size=rt.world_size, prep=prep, pin_memory=rt.device.type == "cuda",
        patience=waiting_patience(rt),
    )  # fmt: skip


def waiting_patience(rt: D.Runtime) -> Patience:
    """How this rank waits for shards once training began (`Patience`): it reports a long wait
    on stderr (every minute; every eighth of a shorter collective timeout), and in a job across
    machines gives up 2 minutes before the collective timeout (half-way through a shorter one:
    its peers entered their collective up to a step's setup earlier)."""
    timeout = rt.timeout.total_seconds()
    who = f"rank {rt.rank}" if rt.multiprocess else "this process"

    def say(text: str) -> None:
        print(f"{who}: {text}", file=sys.stderr, flush=True)

    limit = max(timeout / 2, timeout - 120) if rt.machines > 1 else None
    return Patience(say, min(60.0, timeout / 8), limit, timeout, who)


def initial_weights(
    cfg: TrainConfig, resume: Path | None
) -> tuple[LlamaConfig | None, dict[str, torch.Tensor] | None]:
    """--init-from's shape and weights. A run that resumes a checkpoint takes the shape the
    checkpoint was trained with and no weights: it needs no source (which may be gone)."""
    if not cfg.model.init_from:
        return None, None
    if resume is not None:
        return LlamaConfig.from_dict(ckpt.saved_setting(resume, "model_shape")), None
    return read_source(cfg.model.init_from)


def source_parameters(model: torch.nn.Module, source: LlamaConfig) -> str:
    """The model's parameter count, and whether it is the source's."""
    ours, theirs = model.num_parameters(), parameter_count(source)
    if ours == theirs:
        return f"parameters: {ours:,}, as the source"
    untied = " (its tied embeddings are untied)" if source.tie_word_embeddings else ""
    return f"parameters: {ours:,}; the source has {theirs:,}{untied}"


def settle(cfg: TrainConfig, resume: Path | None) -> TrainConfig:
    """``cfg`` with its optimizer and learning rate decided: a run that resumes keeps the
    checkpoint's optimizer unless --optimizer says otherwise (`TrainConfig.settle`); the
    checkpoint is read only when --optimizer is not given (a settled cfg reads nothing)."""
    if cfg.optim.optimizer is not None or resume is None:
        return cfg.settle()
    saved = ckpt.saved_part(resume, "settings")
    return cfg.settle(saved.get("optimizer", "adamw") if saved else None)


def build_trainer(
    cfg: TrainConfig,
    rt: D.Runtime,
    *,
    fault: FaultHook | None = None,
    resume: Path | None = None,
    fused: bool | None = None,
    data: TrainData | None = None,
) -> Trainer:
    """data -> model (on the meta device) -> parallelized model, given its initial weights (or
    --init-from's) where this rank keeps them -> optimizer -> schedule -> checkpointer and
    evaluator -> Trainer, for this rank (``resume``: the checkpoint to continue, see
    ``Checkpointer.resume_point``; ``fused``: see ``build_optimizer``; ``data``: auto's)."""
    cfg = settle(cfg, resume)
    source_config, weights = initial_weights(cfg, resume)
    if source_config is not None:
        cfg.check_source(source_config)  # before any data is read
    tasks = load_tasks(cfg.eval.task_specs(), cfg.eval.eval_limit, cfg.data.cache_path())
    micro = cfg.data.micro_batch(rt.world_size)  # auto: measured once the model is built
    auto = wants_auto(cfg.data.micro_batch_size, rt.device, rt.mode)
    kernel_choice.check(cfg.runtime.attention, rt.device)  # before any data
    shape = source_config or cfg.model_config(cfg.data.vocab_size)  # its depth and width
    shards = rt.world_size if rt.mode == "fsdp" else 1  # FSDP: a rank keeps its share
    shape.check_batch_fits(1 if auto else micro, cfg.data.seq_length, rt.device, shards)
    data = data or run_data(cfg, rt)
    saved = ckpt.saved_part(resume, "precision") if resume is not None else None
    dtype, reason = training_dtype(cfg.runtime.dtype, rt.device, saved and saved["dtype"])
    precision = Precision(dtype, rt.device, reason)
    allow_tf32(rt.device)
    model = empty_model(cfg.model_config(data.vocab_size, source_config))
    init = Init(model, cfg.runtime.seed, weights, f"--init-from {cfg.model.init_from}")
    total_steps = cfg.schedule.total_steps(data.sampler.steps_per_epoch)
    done = ckpt.saved_part(resume, "train") if resume is not None else None  # a resumed run's
    compiled, why = cfg.compiles(rt, model.config, total_steps, done)  # auto: by what is left
    checkpointing = cfg.runtime.activation_checkpointing
    train_model = parallelize(
        model, rt, precision, init,
        checkpointing=checkpointing, compile=compiled,
    )  # fmt: skip
    if weights is not None and rt.is_main:
        print(source_parameters(model, source_config), flush=True)
    optimizer = cfg.optim.build(  # Muon's Newton-Schulz compiled where the layers are
        model, fused=fused, dtype=precision.dtype, mesh=replica_mesh(train_model), compiled=compiled
    )
    share = functools.partial(D.broadcast_object, rt=rt)  # every rank takes rank 0's backend
    trial = kernel_choice.Shape.of(model.config, dtype, min(micro, 16), cfg.data.seq_length)
    kernel_choice.take(rt.device, trial, cfg.runtime.attention, share)
    fitted = auto and fit_micro_batch(rt, data, train_model, model, precision, checkpointing)
    check_steps(cfg.runtime.profile(), total_steps)  # --epochs: known once the data is
    schedule = ScheduleState(build_schedule(cfg.schedule, cfg.optim.lr, total_steps))
    batch = data.sampler.micro_batch * cfg.data.seq_length  # the tasks' forwards: a micro-batch's
    scorer = TaskEvaluator(tasks, data.tokenizer, data.special.ids.bot, batch) if tasks else None
    scored = sum(len(c) + len(x) for c, x in (scorer.requests if scorer else []))  # its tasks'
    budget = cfg.time_budget(model.num_parameters(), process_age(), task_tokens=scored)
    state = TrainState(budget=budget)
    parts: dict[str, ckpt.Stateful] = {
        "settings": ckpt.Settings(
            {
                "model_shape": model.config.to_dict(),
                **data.resume_key(),
                "optimizer": cfg.optim.optimizer,
            },
            implied={"optimizer": "adamw"},  # what checkpoints from before the choice used
        ),
        "model": ckpt.ModelState(model),
        "optimizer": ckpt.OptimizerState(model, optimizer),
        "scaler": precision.scaler,
        "precision": precision,
        "train": state,
        "schedule": schedule,
        "rng": ckpt.RNGState(),
    }
    checkpointer = Checkpointer(
        cfg.checkpoint.out_dir, parts, rt, every=cfg.checkpoint.save_every,
        keep_last=cfg.checkpoint.keep_last, collective=is_sharded(model),
        on_complete=functools.partial(fault, "after-save") if fault else None,
    )  # fmt: skip
    every, tokens = cfg.eval.eval_every, cfg.eval.budget()
    evaluator = Evaluator(data, model, precision, rt, every=every, tokens=tokens, tasks=scorer)
    if budget is not None:  # every rank follows rank 0's plans; `all`: the held-out split's size
        budget.share, budget.held_out = share, evaluator.held_out_targets
    return Trainer(
        rt, data, model, train_model, optimizer, precision, schedule, checkpointer, evaluator,
        grad_clip=cfg.optim.grad_clip,
        peak_tflops=cfg.runtime.peak_tflops,
        state=state,
        fault=fault or no_fault,
        profiler=StepProfiler(cfg.runtime.profile(), cfg.checkpoint.out_dir, rt.device, rt.is_main),
        micro_batch_note=fitted or None,
        compile_note=f"compile: {'on' if compiled else 'off'} ({why})",
    )  # fmt: skip


def resume(trainer: Trainer, cfg: TrainConfig, path: Path | None) -> list[str]:
    """Continue ``trainer`` from the checkpoint at ``path`` (None: a new run); the notes to print
    about what the resumed run changes."""
    notes = []
    if path is not None:
        step = trainer.checkpointer.load(path)
        trainer.check_start(path, cfg.schedule.max_steps)
        notes.append(f"resuming from {path} (step {step})")
    if trainer.state.budget is not None:  # its plan so far (a checkpoint's), re-planned on
        notes += trainer.state.budget.start(trainer.schedule, trainer.state.step)
    if path is None:
        return [f"initial weights from {cfg.model.init_from}"] * bool(cfg.model.init_from) + notes
    schedule_note = continue_schedule(
        trainer.schedule, step, trainer.checkpointer.saved(), cfg.schedule.warmup_steps is None
    )
    if schedule_note:
        notes.append(f"note: {schedule_note}")
    if cfg.model.init_from:
        notes.append(f"note: --init-from {cfg.model.init_from} unused: the checkpoint is newer")
    return notes


def continue_schedule(
    schedule: ScheduleState, step: int, saved: dict[int, Path], adopt_warmup: bool
) -> str | None:
    """Resume ``schedule`` at ``step`` (steps taken) from the one its checkpoint was trained
    under: adopt the checkpoint's warmup when ``adopt_warmup`` (its default depends on the run's
    length, which a resume may change), and say what else changes (None: nothing). A UserError
    when the checkpoint is inside a decay (WSD's) that the new schedule would undo; ``saved``
    maps the steps of the checkpoints at hand to their folders, to name one to resume instead."""
    before, now = schedule.saved, schedule.current
    if adopt_warmup:
        now = replace(now, warmup_steps=before.warmup_steps)
    schedule.current = now
    if before == now:
        return None
    changes = before.changes(now)
    start = before.decay_start()
    if start is not None and step > start:
        earlier = [s for s in saved if s <= start]
        instead = (
            f"or resume from {saved[max(earlier)]}, the last checkpoint before the decay, with "
            "--resume"
            if earlier
            else "or start a new run: no checkpoint from before the decay is kept (next time "
            f"save one at step {start} with --save-every)"
        )
        raise UserError(
            f"the checkpoint at step {step} is inside the {before.name.upper()} decay that began "
            f"at step {start}, and this run changes its schedule ({changes}), which would undo "
            f"the decay (resume with the schedule it was trained with, {instead})"
        )
    return _schedule_change(before, now, step, changes)


def _schedule_change(before: Schedule, now: Schedule, step: int, changes: str) -> str:
    if before.decay_start() is not None and now.decay_start() is not None and now(step) == now.lr:
        return (
            f"schedule changed ({changes}): step {step} continues the stable phase at lr "
            f"{now.lr:.3g}; the decay now starts at step {now.decay_start()} (was "
            f"{before.decay_start()})"
        )
    return (
        f"schedule changed ({changes}): step {step} runs at lr {now(step):.3g} "
        f"(the checkpoint's schedule: {before(step):.3g})"
    )


def describe(cfg: TrainConfig, rt: D.Runtime, trainer: Trainer) -> list[str]:
    """The start-up lines: what this run trains, how, on what, from where to where, and with
    which attention kernel."""
    model, data, sampler = trainer.model, trainer.data, trainer.data.sampler
    budget = trainer.state.budget
    steps = "(planned)" if trainer.total_steps == PROVISIONAL_STEPS else trainer.total_steps
    return [
        f"{model.config.num_hidden_layers} layers, {model.num_parameters() / 1e6:.1f}M "
        f"parameters | mode {rt.mode} x{rt.world_size} on {rt.device} | {data.describe()}, "
        f"batch {cfg.data.batch_size} = {sampler.micro_batch} x {rt.world_size} x "
        f"{sampler.accum_steps} accumulation | steps {trainer.state.step} -> {steps}",
        *([trainer.micro_batch_note] if trainer.micro_batch_note else []),
        f"special tokens: {data.special.describe()}",
        f"optimizer: {cfg.optim.optimizer}, peak lr {trainer.schedule.current.lr:g} "
        f"({cfg.schedule.lr_schedule})",
        trainer.precision.describe(),
        trainer.compile_note,  # the build's own decision, not a second estimate
        kernel_choice.banner(rt.device, trainer.precision.dtype, model.config.head_dim),
        *([budget.banner()] if budget is not None else []),
    ]


def export(trainer: Trainer, cfg: TrainConfig) -> None:
    """llama_model.pth, llama_model.json, tokenizer.json, hf/ and model.gguf, as one set
    (`export_run`; every rank gathers the weights, rank 0 writes)."""
    state = trainer.checkpointer.parts["model"].full_state_dict()
    if not trainer.rt.is_main:
        return
    out, data, output = Path(cfg.checkpoint.out_dir), trainer.data, cfg.output
    export_run(
        state, trainer.model.config, out, data.tokenizer_path, data.special,
        hf=output.export_hf, gguf_type=output.export_gguf,
    )  # fmt: skip


@contextlib.contextmanager
def run_folder(out_dir: str | Path, rt: D.Runtime) -> Iterator[None]:
    """Rank 0 owns the run folder for the block: created, locked against a second run (a new
    one removed again if the run is refused before writing in it), and rid of what a killed run
    left half-written."""
    if not rt.is_main:
        yield
        return
    with safe_io.own_run_dir(out_dir) as out:
        for path in safe_io.remove_temporaries(out):
            print(f"removed {path}, left half-written by a run that was killed", flush=True)
        yield


def open_reporter(cfg: TrainConfig, rt: D.Runtime, trainer: Trainer) -> Reporter:
    """Rank 0's progress bar, metrics.jsonl and loggers, from the step the run starts at."""
    return Reporter(
        Path(cfg.checkpoint.out_dir),
        trainer.total_steps,
        trainer.state.step,
        enabled=rt.is_main,
        every=cfg.output.log_every,
        loggers=cfg.output.loggers(),
        run_config=cfg.flags(),  # flat, by flag name, as runs before the components logged it
    )


def run(cfg: TrainConfig, *, fault: FaultHook | None = None) -> int:
    """Train as ``cfg`` says here: 0 when done (a signal in the export too), else the signal."""
    with Preemption() as preemption:
        rt = runtime(cfg.runtime.mode, cfg.runtime.device)
        out_dir = cfg.checkpoint.out_dir
        try:
            with run_folder(out_dir, rt):
                path = Checkpointer.resume_point(out_dir, cfg.checkpoint.resume, rt)
                if not rt.is_main:  # rank 0 holds the lock by now: tidy a node's own disk
                    remove_shard_leftovers(out_dir)
                sized = choose_size(cfg, rt, path, functools.partial(run_data, rt=rt))
                cfg = settle(sized.cfg, path)  # what the run's lines and loggers say it trains with
                trainer = build_trainer(cfg, rt, fault=fault, resume=path, data=sized.data)
                if cfg.output.export_gguf is not None:  # refused now, not after training
                    check_tokenizer(trainer.data.tokenizer_path)
                notes = resume(trainer, cfg, path) + sized.lines  # another tokenizer's: refused
                if rt.is_main:  # a run stopped early is resumed or sampled with its tokenizer
                    data = trainer.data
                    write_tokenizer_files(data.tokenizer_path, data.special, Path(out_dir))
                reporter = open_reporter(cfg, rt, trainer)
                try:
                    for line in [*notes, *describe(cfg, rt, trainer)]:
                        reporter.info(line)
                    precision = trainer.precision
                    warning = emulation_warning(precision.dtype, rt.device)
                    if warning:
                        reporter.info(warning)
                    reporter.log(
                        {"step": trainer.state.step, "dtype": precision.name,
                         "dtype_reason": precision.reason}
                    )  # fmt: skip
                    saves = [r["save_s"] for r in reporter.kept if "save_s" in r]
                    if saves:  # the run this one resumes: were its saves too slow to survive?
                        trainer.last_save_s = saves[-1]
                        warning = slow_save_warning(saves[-1], grace_seconds())
                        if warning:
                            reporter.info(warning)
                    preemption.training()
                    signum = trainer.fit(reporter, preemption)
                    if signum:
                        return signum
                    vote = functools.partial(D.any_rank, rt=rt)
                    step, latest = trainer.state.step, trainer.checkpointer.latest()
                    if signum := preemption.since_training(vote):  # in the last evaluation or save
                        reporter.info(preemption.late_line(signum, step, latest, exported=False))
                        return signum
                    export(trainer, cfg)
                    gguf, budget = cfg.output.export_gguf is not None, trainer.state.budget
                    summary = run_summary(Path(out_dir), latest, cfg.output.export_hf, gguf,
                                          budgeted=budget is not None)  # fmt: skip
                    reporter.info(summary + save_time_note(trainer.last_save_s))
                    reporter.info(time_line(trainer.state.time.record()))
                    if budget is not None and (late := budget.end_line()):  # what it missed
                        reporter.info(late)
                    if signum := preemption.since_training(vote):  # in the export: all was done
                        reporter.info(preemption.late_line(signum, step, latest, exported=True))
                    D.barrier(rt)  # leave together: a rank tearing down early can abort a peer
                    return 0
                finally:
                    reporter.close()
                    trainer.data.close()  # the token cache's builder, if it still runs
        finally:
            D.teardown(rt)
