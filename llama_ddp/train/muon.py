"""Muon for the decoder layers' matrices, AdamW for the rest: ``--optimizer muon`` (optim.py).

Muon (torch.optim.Muon; Keller Jordan's, https://kellerjordan.github.io/posts/muon/) updates a
hidden 2-D weight matrix with its momentum orthogonalized by a few Newton-Schulz iterations. As in
every Muon recipe, it takes only the hidden matrices (attention and MLP projections); the
embedding, the norms and the lm_head stay with AdamW. The learning rate of a Muon matrix is
adjusted by its shape as torch's ``adjust_lr_fn="match_rms_adamw"`` does (Moonshot's "Muon is
Scalable for LLM Training"): lr x 0.2 x sqrt(max(rows, cols)), which gives its update the RMS of
a typical AdamW update, so one learning rate, schedule and weight decay serve both halves.

`Muon` is torch.optim.Muon's update and state (a ``momentum_buffer`` per matrix, saved by
parameter name), computed differently in three ways:
- Newton-Schulz runs in ``ns_dtype``, the run's precision (optim.py): fp32 in an fp32 run, where
  its iterations would otherwise amplify the last-bit differences between modes; bf16 in a bf16
  run on a device that multiplies it natively (torch's choice, everywhere).
- Matrices of one shape are orthogonalized together: stacked, one batched product per iteration
  (`orthogonalize`), not a short loop of small products per matrix.
- Newton-Schulz is compiled (``compiled``; optim.py asks for it where the run compiles its
  layers, on CUDA by default): one fused graph per stack shape (a model has about four), its
  elementwise work fused around the batched products, the eager path otherwise.
- Ranks share the work. Under DDP (``mesh``: every rank holds the same gradients) each rank
  orthogonalizes its share of each stack and the results are all-gathered; under FSDP2 (the
  parameters are DTensors sharded by rows) the stack of row shards is redistributed into whole
  matrices, a share per rank (an all-to-all), orthogonalized, and redistributed back into row
  shards. The momentum stays a DTensor sharded like its parameter, so DCP saves and reshards it
  as any other state: a checkpoint resumes across single, DDP and FSDP at any world size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import _muon

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def orthogonalize(
    stack: torch.Tensor, dtype: torch.dtype, coefficients: Sequence[float], steps: int, eps: float
) -> torch.Tensor:
    """torch.optim.Muon's quintic Newton-Schulz orthogonalization of each matrix of ``stack``
    (matrices, rows, cols), all at once, computed in ``dtype`` (torch's: bf16)."""
    a, b, c = coefficients
    x = stack.to(dtype)
    tall = stack.size(-2) > stack.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm at most 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (FSDP), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class Muon(torch.optim.Muon):
    """torch.optim.Muon (its defaults, update, state and checkpoint format), with Newton-Schulz in
    ``ns_dtype``, batched by shape and shared out over the ranks (see the module docstring).
    ``mesh``: the ranks that hold the same whole gradients (DDP's); None for one process, and
    for DTensor parameters (FSDP), whose own mesh is used. ``compiled``: Newton-Schulz through
    torch.compile."""

    def __init__(
        self,
        params: Iterable,
        *,
        ns_dtype: torch.dtype,
        mesh: DeviceMesh | None = None,
        compiled: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, **kwargs)
        self.ns_dtype, self.mesh = ns_dtype, mesh
        # Shapes static: each stack's shape is fixed for the run, so each gets its own kernels.
        self.compiled = (
            torch.compile(orthogonalize, fullgraph=True, dynamic=False) if compiled else None
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """torch's `_single_tensor_muon`, elementwise on each rank's part, Newton-Schulz by
        shape (`_orthogonalized`)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            if not params:
                continue
            lr, momentum = group["lr"], group["momentum"]
            grads, buffers = [_local(g) for g in grads], [_local(b) for b in buffers]
            torch._foreach_lerp_(buffers, grads, 1 - momentum)
            updates = (
                torch._foreach_lerp(grads, buffers, momentum) if group["nesterov"] else buffers
            )
            local = [_local(p) for p in params]
            torch._foreach_mul_(local, 1 - lr * group["weight_decay"])  # decoupled, unadjusted lr
            by_shape: dict[torch.Size, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault(p.shape, []).append(i)
            for shape, index in by_shape.items():
                done = self._orthogonalized([updates[i] for i in index], params[index[0]], group)
                lr_of_shape = _muon._adjust_lr(lr, group["adjust_lr_fn"], shape)
                torch._foreach_add_([local[i] for i in index], done, alpha=-lr_of_shape)
        return loss

    def _orthogonalized(
        self, updates: list[torch.Tensor], param: torch.Tensor, group: dict[str, Any]
    ) -> list[torch.Tensor]:
        """The orthogonalized ``updates`` (this rank's parts of same-shaped matrices, shaped like
        ``param``), each rank computing a share of the whole matrices."""
        stack = torch.stack(updates)

        def newton_schulz(x: torch.Tensor) -> torch.Tensor:
            if len(x) == 0:  # more ranks than matrices of this shape
                return x.to(self.ns_dtype)
            return (self.compiled or orthogonalize)(
                x, self.ns_dtype, group["ns_coefficients"], group["ns_steps"], group["eps"]
            )

        sharded = hasattr(param, "device_mesh")  # a DTensor
        if not sharded and self.mesh is None:
            return list(newton_schulz(stack).unbind(0))
        # Imported here (~0.5 s): by the runs of several processes only.
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if sharded:
            if tuple(param.placements) != (Shard(0),):
                raise ValueError(f"Muon takes row-sharded DTensors, not {param.placements}")
            mesh, placement = param.device_mesh, Shard(1)  # the stack of row shards
        else:
            mesh, placement = self.mesh, Replicate()  # every rank holds every whole matrix
        rows, cols = param.shape
        size, stride = torch.Size((len(updates), rows, cols)), (rows * cols, cols, 1)
        whole = DTensor.from_local(stack, mesh, [placement], shape=size, stride=stride)
        share = newton_schulz(whole.redistribute(mesh, [Shard(0)]).to_local())
        done = DTensor.from_local(share, mesh, [Shard(0)], shape=size, stride=stride)
        return list(done.redistribute(mesh, [placement]).to_local().unbind(0))


class Optimizers:
    """Several torch optimizers stepped as one, over disjoint parameters: what the trainer, the
    gradient scaler and the learning-rate schedule see (``param_groups``, ``step``,
    ``zero_grad``); a checkpoint saves ``optimizers`` (DCP keys each state by parameter name)."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    @property
    def state(self) -> dict[torch.Tensor, Any]:
        return {p: s for opt in self.optimizers for p, s in opt.state.items()}

    def step(self, closure: None = None) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)


def hidden_matrices(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters Muon takes: the decoder layers' 2-D weights (attention and MLP
    projections), never the embedding, the lm_head or a norm."""
    return [
        p
        for name, p in model.named_parameters()
        if p.requires_grad and p.dim() == 2 and ".layers." in f".{name}"
    ]


# The lr factor 0.2 x sqrt(max(rows, cols)) (match_rms_adamw) for any matrix up to 2**24 wide.
LR_FACTOR_MAX = 0.2 * 2**12


def largest_step_scalar(lr: float, beta1: float, weight_decay: float) -> float:
    """An upper bound of the scalars an optimizer step forms from ``lr``, all float32 on the
    device: AdamW's step size lr / (1 - beta1^t) (largest at t = 1), Muon's lr x its shape
    factor (`LR_FACTOR_MAX`; momentum 0.95), and either's decay lr x weight_decay."""
    return lr * max(1.0, weight_decay) * LR_FACTOR_MAX / (1 - max(beta1, 0.95))
