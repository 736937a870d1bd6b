"""The one place the model to train is made, for each mode (`MODES`).

``runtime`` resolves ``--mode`` and starts what the mode needs (a torchrun process group or not);
``empty_model`` makes the plain LlamaForPretraining on the meta device (shapes, no memory);
``parallelize`` applies, outside the model and in this order, activation checkpointing,
``torch.compile`` (each decoder layer) and the mode's wrapper (DataParallel, DDP, FSDP2), and
gives the weights their initial values (`Init`) where the mode holds them: whole on every rank,
or for FSDP each rank its shards only, never the whole model. The loop asks ``gradient_sync``
whether a micro-step reduces gradients, ``zero_grad`` to clear them, ``is_sharded`` whether every
rank holds a part of the state, the optimizer ``replica_mesh`` which ranks hold the same
gradients; none tests the mode.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.runtime import Runtime
from llama_ddp.errors import UserError
from llama_ddp.model.config import LlamaConfig
from llama_ddp.model.llama import LlamaForPretraining, initial_value
from llama_ddp.model.weights import tied_weights
from llama_ddp.precision import Precision

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def empty_model(config: LlamaConfig) -> LlamaForPretraining:
    """The model's structure on the meta device: shapes, no memory and no values yet (`Init`
    gives them on each rank's device, after the mode's wrapper sharded them)."""
    with torch.device("meta"):
        return LlamaForPretraining(config)


def build_model(
    config: LlamaConfig,
    seed: int,
    device: torch.device,
    weights: Mapping[str, torch.Tensor] | None = None,
) -> LlamaForPretraining:
    """The plain model on ``device`` with the initial weights every mode and rank starts from
    (see `Init`)."""
    model = empty_model(config)
    Init(model, seed, weights).materialize(device)
    return model


class Init:
    """A run's initial weights, given to ``model`` (built by `empty_model`) on its device: drawn
    from ``seed`` (`model.initial_value`: the same values in every mode, at any world size), or
    read from ``weights`` (--init-from's state dict, our names; lazily mapped from its files, so
    each rank reads the slices it keeps, `source` names it in errors).

    Made before any wrapper: activation checkpointing renames parameters and FSDP replaces them,
    but neither replaces the modules that hold them."""

    def __init__(
        self,
        model: LlamaForPretraining,
        seed: int,
        weights: Mapping[str, torch.Tensor] | None = None,
        source: str = "the initial weights",
    ) -> None:
        self.model, self.seed, self.weights = model, seed, weights
        self.targets, seen = [], set()
        for prefix, module in model.named_modules():
            for name, tensor in [
                *module.named_parameters(recurse=False),
                *module.named_buffers(recurse=False),
            ]:
                if id(tensor) not in seen:  # a tied lm_head is the embedding: filled once
                    seen.add(id(tensor))
                    self.targets.append((f"{prefix}.{name}" if prefix else name, module, name))
        if weights is not None:
            self.weights = tied_weights(model.config, weights, source)
            self._check(source)

    def _check(self, source: str) -> None:
        """Every weight present and of its shape; rotary tables a file lacks (a Hugging Face one
        has none) are the model's own, constants of its config."""
        shapes = {name: getattr(module, attr).shape for name, module, attr in self.targets}
        tables = {n for n in shapes if n.startswith("base_model.rotary_emb.")}
        missing = sorted(set(shapes) - tables - set(self.weights))
        extra = sorted(set(self.weights) - set(shapes))
        wrong = [n for n in shapes if n in self.weights and self.weights[n].shape != shapes[n]]
        if missing or extra or wrong:
            problem = (
                f"it lacks {missing[0]}"
                if missing
                else f"it has {extra[0]}, which the model lacks"
                if extra
                else f"{wrong[0]} is {tuple(self.weights[wrong[0]].shape)} in it, "
                f"{tuple(shapes[wrong[0]])} in the model"
            )
            raise UserError(f"{source} does not match its config ({problem})")

    def materialize(self, device: torch.device) -> None:
        """Allocate the model's parameters and buffers on ``device`` (for a sharded model, this
        rank's shards) and fill them: one full value at a time on the host, of which each rank
        copies its own part."""
        self.model.to_empty(device=device)
        if self.model.config.tie_word_embeddings:  # to_empty gave each module its own tensor
            self.model.lm_head.weight = self.model.base_model.embed_tokens.weight
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for name, module, attr in self.targets:
                target = getattr(module, attr)
                if self.weights is not None and name in self.weights:
                    value = self.weights[name]
                else:
                    value = initial_value(self.model.config, name, target.shape, generator)
                local = target.to_local() if hasattr(target, "to_local") else target
                local.copy_(_local_part(value, target))


def _local_part(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of the full ``value`` that ``target`` (a DTensor shard, or a plain tensor: all of
    it) holds on this rank: a slice, so a lazily mapped file is read for that part only."""
    if not hasattr(target, "device_mesh"):
        return value
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        value.shape, target.device_mesh, target.placements
    )
    return value[tuple(slice(start, start + n) for start, n in zip(offset, shape))]


class Autocast(nn.Module):
    """Runs ``module`` under the run's autocast, its dtype named explicitly.

    DataParallel runs each replica in a thread of its own and re-enters autocast there with
    ``enabled=`` only; the autocast dtype is per thread, and a new thread's is the device default
    (fp16 on CUDA), so a bf16 run would compute in fp16 without loss scaling. This module is what
    DataParallel replicates: every replica thread enters the run's dtype itself."""

    def __init__(self, module: nn.Module, precision: Precision) -> None:
        super().__init__()
        self.module, self.precision = module, precision

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision.autocast():
            return self.module(*args, **kwargs)


def checkpoint_layers(model: LlamaForPretraining) -> None:
    """Recompute each decoder layer's forward in the backward instead of keeping its activations
    (torch.utils.checkpoint, non-reentrant). The layers' state-dict names gain a
    ``_checkpoint_wrapped_module.`` level, which torch.distributed.checkpoint's state-dict
    functions (checkpoint/state.py, the export) remove: saved names never change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    layers = model.base_model.layers
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT)


def compile_layers(model: LlamaForPretraining, backend: str = "inductor") -> None:
    """torch.compile each decoder layer in place, whole (the attention operator is opaque to it,
    activation checkpointing traced inside; ``fullgraph``: a graph break is an error), before
    any data-parallel wrapper: DDP's and FSDP's hooks stay outside the graphs, so each layer's
    gradients are reduced while the backward of the layers below runs. The final norm too, and
    the loss's chunks (model/loss.py: each chunk's softmax, loss and gradient one fused pass over
    its logits instead of eager's several).

    The sizes that change with every batch are symbolic from the first compile (``dynamic``: the
    token count, the longest segment; the plan's segment and grid tensors unbacked, so that a
    batch with one grid or no padded one is no special case): one graph for every batch."""
    from torch._dynamo.decorators import mark_unbacked

    def unbacked_plan(module: nn.Module, args: tuple) -> None:
        plan = args[2] if len(args) > 2 else None
        if plan is not None:
            for t in (plan.cu_seqlens, plan.grids, plan.slots, plan.padding):
                mark_unbacked(t, 0)

    model.base_model.register_forward_pre_hook(unbacked_plan)
    for layer in model.base_model.layers:
        layer.compile(backend=backend, fullgraph=True, dynamic=True)
    model.base_model.norm.compile(backend=backend, fullgraph=True, dynamic=True)
    model.loss_backend = backend


def parallelize(
    model: LlamaForPretraining,
    rt: Runtime,
    precision: Precision,
    init: Init | None = None,
    *,
    checkpointing: bool = False,
    compile: bool = False,
) -> nn.Module:
    """The module to run forward/backward through. ``model`` keeps the weights (saving,
    evaluation and export read it, never a wrapper); FSDP shards it in place. ``init`` gives a
    model built on the meta device (`empty_model`) its initial weights once the mode knows
    which part each rank holds (None: ``model`` has them). ``checkpointing`` and ``compile``:
    --activation-checkpointing and --compile, per decoder layer."""
    if checkpointing:
        checkpoint_layers(model)
    if compile:
        compile_layers(model)
        if rt.mode == "ddp":
            # Dynamo's DDPOptimizer would split each layer's graph at DDP's bucket sizes (1 MiB,
            # then 25 MB); compiled layer by layer, DDP's hooks already overlap the backward.
            import torch._dynamo

            torch._dynamo.config.optimize_ddp = False

    def materialize() -> None:
        if init is not None:
            if rt.device.type != "cpu":  # the host's RAM was checked with the config
                model.config.check_fits(rt.device, rt.world_size if rt.mode == "fsdp" else 1)
            init.materialize(rt.device)

    return MODES[rt.mode].wrap(model, rt, precision, materialize)


def _unwrapped(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, materialize: Callable
) -> nn.Module:
    materialize()
    return model


class _DataParallel(nn.DataParallel):
    """nn.DataParallel whose replicas each get the attention plan of their own rows (made on
    the host from the batch's masks; DataParallel synchronizes every step anyway) and the
    labels of their own output rows; their loss sums are added up."""

    def scatter(self, inputs, kwargs, device_ids):
        plan = kwargs.pop("plan", None) if kwargs else None
        labels = kwargs.pop("labels", None) if kwargs else None
        inputs, kwargs = super().scatter(inputs, kwargs, device_ids)
        start = first = 0
        for replica_inputs, replica_kwargs in zip(inputs, kwargs):
            x = replica_inputs[0]  # input_ids, split by rows
            outputs = x.numel()  # output rows: every position
            if plan is not None:
                rows = plan.rows(start, start + len(x))
                replica_kwargs["plan"] = rows.to(x.device)
                outputs = rows.positions.numel()  # pad mode: the computed positions only
            if labels is not None:
                replica_kwargs["labels"] = labels[first : first + outputs].to(x.device)
            start, first = start + len(x), first + outputs
        return inputs, kwargs

    def gather(self, outputs, output_device):
        if outputs[0].dim() == 0:  # each replica's loss sum
            return torch.stack([loss.to(output_device) for loss in outputs]).sum()
        return super().gather(outputs, output_device)


def _data_parallel(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, materialize: Callable
) -> nn.Module:
    """nn.DataParallel over this process's GPUs (RuntimeSettings refuses it with --compile); the
    plain model when there is one device."""
    materialize()
    if rt.replicas > 1:
        return _DataParallel(Autocast(model, precision))
    return model


def _distributed_data_parallel(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, materialize: Callable
) -> nn.Module:
    """DDP around the model (whose layers are compiled, if they are: a compiled model's one
    backward graph would hold every reduction back to its end); its gradients: `zero_grad`."""
    materialize()
    ids = [rt.device.index] if rt.device.type == "cuda" else None
    # The rotary tables are constants: no need to broadcast buffers every forward.
    params = inspect.signature(DistributedDataParallel).parameters
    no_sync = "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    return DistributedDataParallel(
        model, device_ids=ids, gradient_as_bucket_view=True, **{no_sync: False}
    )


def _fully_shard(
    model: LlamaForPretraining, rt: Runtime, precision: Precision, materialize: Callable
) -> nn.Module:
    """FSDP2: each decoder layer, then the root (embeddings, final norm, lm_head), sharded over
    the processes, then each rank's shards materialized: no rank ever holds the whole model.
    Low-precision runs compute in their dtype and keep fp32 master weights and fp32 gradient
    reduction; fp32 runs use no policy."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(rt.device.type, (rt.world_size,))
    policy = MixedPrecisionPolicy()
    if precision.dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=precision.dtype, reduce_dtype=torch.float32)
    for layer in model.base_model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    materialize()
    return model


@dataclass(frozen=True)
class Mode:
    """One entry of `MODES`: what ``--mode NAME`` means."""

    help: str
    process_group: bool  # its processes form a torchrun process group (collectives are real)
    # (model, runtime, precision, materialize): the module to train; it calls materialize()
    # (`Init`) once the weights are where this mode keeps them
    wrap: Callable[[LlamaForPretraining, Runtime, Precision, Callable[[], None]], nn.Module]


# The modes ``--mode`` offers (besides ``auto``); a new one is an entry here, plus its branch of
# ``gradient_sync``, ``zero_grad`` and ``is_sharded`` if it syncs, keeps or shards its own way.
MODES: dict[str, Mode] = {
    "single": Mode("one process on one device", False, _unwrapped),
    "dp": Mode("nn.DataParallel over this machine's GPUs", False, _data_parallel),
    "ddp": Mode("DistributedDataParallel under torchrun", True, _distributed_data_parallel),
    "fsdp": Mode(
        "FSDP2 under torchrun: weights, gradients and optimizer state sharded over the processes",
        True,
        _fully_shard,
    ),
}


def runtime(mode: str = "auto", device: str = "auto") -> Runtime:
    """This process's Runtime for ``--mode`` (``auto``: ddp under torchrun, else single) and
    ``--device``: under torchrun, a mode with a process group joins it."""
    if mode == "auto":
        mode = "ddp" if D.under_torchrun() else "single"
    return D.setup(mode, device, process_group=MODES[mode].process_group)


def is_sharded(model: nn.Module) -> bool:
    """Whether every rank holds only a part of the weights (and so writes a part of each
    checkpoint)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def gradient_sync(train_model: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of a micro-step's backward: with ``sync`` false (all but the last micro-step of
    an optimizer step) DDP's gradients accumulate locally and are reduced once, on the last.
    FSDP reduce-scatters every micro-step (torchtitan's choice): its gradients accumulate as
    shards, never as the whole model's (4 bytes per parameter more on every rank)."""
    if not sync and isinstance(train_model, DistributedDataParallel):
        return train_model.no_sync()
    return contextlib.nullcontext()


def zero_grad(train_model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Clear the gradients after a step: DDP's in place, as views into its all-reduce buckets
    (gradient_as_bucket_view) that every backward, no_sync's too, accumulates into; set to None,
    each backward would make fresh ones beside the buckets for the reducer to copy in (torch's
    DDP docs: "the bucket view alias is destroyed every iteration"). Elsewhere None frees them."""
    optimizer.zero_grad(set_to_none=not isinstance(train_model, DistributedDataParallel))


def replica_mesh(train_model: nn.Module) -> DeviceMesh | None:
    """The ranks that hold the same whole gradients after a step's backward (DDP's process
    group) as a DeviceMesh, over which they share work on them (Muon's orthogonalizations);
    None for one process, and under FSDP, whose sharded parameters carry their own mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(train_model, DistributedDataParallel):
        return None
    group = train_model.process_group
    if torch.distributed.get_world_size(group) < 2:
        return None
    return DeviceMesh.from_group(group, next(train_model.parameters()).device.type)
