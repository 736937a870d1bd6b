"""Which attention backend a run takes (train.py's ``--attention``, issue 45): each candidate of
attention_plan/backends.py that runs on this device timed on the run's shape; the fastest that is
proven exact.

- **Timed**: forward and backward of one layer's attention over the run's micro-batch (at most
  16 rows), ``WARMUP`` untimed calls (first-call costs: handles, lazy initialization, paid once
  by a run), then ``REPEATS`` calls each on a new layout of documents, on the device's clock
  (`timing`): training meets a new layout every micro-batch, and a kernel that builds something
  per grid shape (cuDNN: measured on an H200 at 64 x 1024, 1.7 s on a layout's first call, 15 ms
  again; flash varlen 2.4 ms either way) pays it again and again as the run does. A backend whose
  timed call takes over ``SLOWER`` times the fastest median so far has lost and is not timed
  further; the trials stop at ``CHOICE_SECONDS`` in all; the banner says what the choice took.
  A trial that runs out of memory is run again, every backend, at half the rows (down to 1): the
  banner names the out-of-memory and the rows timed.
- **Exact** (the fastest first, until one passes): on four documents of random q, k, v
  (grouped-query like the model) and on one packed layout of the run's own sequence length, the
  backend's output and its gradients of q, k and v are within twice what SDPA itself errs in the
  run's dtype, plus 1e-3, of float64 attention of the same inputs (`errors`: bf16's own error,
  which no kernel beats; a kernel that lets documents see each other, or drops causality, errs
  by O(1)).

A backend that raises, loses, or errs is passed over and the banner says why. Under torchrun rank
0 chooses and every rank takes its choice (`take`'s ``share``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from llama_ddp.attention_plan import backends, varlen
from llama_ddp.attention_plan.backends import Backend
from llama_ddp.attention_plan.plan import AttentionPlan, plan_attention
from llama_ddp.errors import UserError
from llama_ddp.model.attention import attend

Tensor = torch.Tensor
WARMUP, REPEATS = 2, 5
SLOWER = 3.0  # a timed call this many times the fastest median so far: that backend lost
CHOICE_SECONDS = 20.0  # the trials' bound, at start-up on every rank
EXACT_LENGTHS = [[5, 200, 51], [256], [1, 18, 3, 234], [90, 166]]  # documents of 4 rows


@dataclass(frozen=True)
class Shape:
    """What a run's attention computes: its dtype, heads, key/value heads, head size, and a
    micro-batch of ``rows`` x ``seq_length`` tokens."""

    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    rows: int
    seq_length: int

    @classmethod
    def of(cls, config, dtype: torch.dtype, rows: int, seq_length: int) -> Shape:
        """The shape of a LlamaConfig's attention at ``rows`` x ``seq_length``."""
        heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
        return cls(dtype, *heads, rows, seq_length)


def _kernel(plan: AttentionPlan, backend: Backend) -> Callable[..., Tensor]:
    plan.kernel = backend.kernel
    return lambda q, k, v: attend(q, k, v, plan)


def _reference(q: Tensor, k: Tensor, v: Tensor, cu: list[int], math: bool) -> Tensor:
    """Causal attention within each segment, one SDPA call each (``math``: float64, exact)."""
    outs = []
    for start, stop in zip(cu[:-1], cu[1:]):
        seg = [x[start:stop].transpose(0, 1).unsqueeze(0) for x in (q, k, v)]
        if math:
            seg = [x.double() for x in seg]
        outs.append(F.scaled_dot_product_attention(*seg, is_causal=True, enable_gqa=True)[0])
    return torch.cat([o.transpose(0, 1) for o in outs]).to(q.dtype)


def errors(
    backend: Backend, device: torch.device, shape: Shape, plan: AttentionPlan | None = None
) -> dict[str, tuple[float, float]]:
    """{"out", "dq", "dk", "dv": (the backend's largest error, its tolerance)} on ``plan``'s
    segments (default: EXACT_LENGTHS' documents), both against float64 attention of the same
    inputs."""
    if plan is None:
        ids = torch.stack(
            [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in EXACT_LENGTHS]
        )
        plan = plan_attention(ids.shape, document_ids=ids)
    cu = plan.cu_seqlens.tolist()
    g = torch.Generator().manual_seed(0)
    n, d = plan.positions.numel(), shape.head_dim
    heads = (shape.heads, shape.kv_heads, shape.kv_heads)
    inputs = [torch.randn(n, h, d, generator=g).to(device, shape.dtype) for h in heads]
    grad = torch.randn(n, shape.heads, d, generator=g).to(device, shape.dtype)

    def run(fn: Callable[..., Tensor]) -> list[Tensor]:
        qkv = [x.clone().requires_grad_() for x in inputs]
        out = fn(*qkv)
        return [t.double() for t in (out, *torch.autograd.grad(out, qkv, grad))]

    backends.activate(backends.BACKENDS["sdpa"])  # torch's own kernels for the references
    exact = run(lambda *x: _reference(*x, cu, math=True))
    sdpa = run(lambda *x: _reference(*x, cu, math=False))
    backends.activate(backend)  # FA3/FA4 replace torch's flash kernels process-wide
    ours = run(_kernel(plan.to(device), backend))
    return {
        name: ((o - e).abs().max().item(), 2 * (s - e).abs().max().item() + 1e-3)
        for name, o, s, e in zip(("out", "dq", "dk", "dv"), ours, sdpa, exact)
    }


def exactness_plans(shape: Shape) -> list[AttentionPlan | None]:
    """What `inexact` checks: EXACT_LENGTHS' documents (None) and, where the run's sequences
    are longer, one packed layout of the run's own length (a kernel wrong only at long rows)."""
    plans: list[AttentionPlan | None] = [None]
    if shape.seq_length > max(map(sum, EXACT_LENGTHS)):
        plans.append(layouts(min(shape.rows, 2), shape.seq_length, 2)[1])
    return plans


def inexact(backend: Backend, device: torch.device, shape: Shape) -> str | None:
    """Why ``backend`` is not exact on `exactness_plans` (it errs more than its tolerance, or
    raises), or None."""
    try:
        for plan in exactness_plans(shape):
            for name, (error, tolerance) in errors(backend, device, shape, plan).items():
                if not error <= tolerance:
                    return f"not exact ({name} off by {error:.3g} > {tolerance:.3g})"
    except Exception as exc:  # a kernel that refuses this device or shape
        return _failed(exc)
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def layouts(rows: int, seq_length: int, count: int) -> list[AttentionPlan]:
    """``count`` plans of ``rows`` x ``seq_length``: whole-row documents first (where attention
    costs most), then packed documents of random lengths (16 tokens to a whole row, seeded):
    the grids change from call to call as they do in training, so a kernel that builds
    something per shape (cuDNN's graphs) pays for it here too."""
    g = torch.Generator().manual_seed(0)
    plans = [plan_attention((rows, seq_length), document_ids=torch.zeros(rows, seq_length).long())]
    for _ in range(count - 1):
        ids = torch.empty(rows, seq_length, dtype=torch.long)
        for r in range(rows):
            cuts = torch.randint(16, seq_length + 1, (seq_length // 16,), generator=g).cumsum(0)
            ids[r] = torch.bucketize(torch.arange(seq_length), cuts, right=True)
        plans.append(plan_attention((rows, seq_length), document_ids=ids))
    return plans


class Lost(Exception):
    """A timed call slower than the trial's ``limit``: ``seconds`` it took."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seconds = seconds


class OutOfTime(Exception):
    """The choice's ``CHOICE_SECONDS`` were spent before a trial ended."""


def timing(
    backend: Backend,
    device: torch.device,
    shape: Shape,
    limit: float | None = None,
    deadline: float | None = None,
) -> float:
    """Median seconds of forward + backward of ``backend`` over the run's micro-batch, on
    `layouts`' plans in turn after ``WARMUP`` calls on the first (untimed: what a run pays once).
    `Lost` where a timed call takes over ``limit`` seconds; `OutOfTime` where the clock
    (time.perf_counter) passes ``deadline`` between calls."""
    rows, t = shape.rows, shape.seq_length
    plans = [p.to(device) for p in layouts(rows, t, REPEATS)]
    n, d = rows * t, shape.head_dim
    heads = (shape.heads, shape.kv_heads, shape.kv_heads)
    qkv = [
        torch.randn(n, h, d, device=device, dtype=shape.dtype, requires_grad=True) for h in heads
    ]
    grad = torch.randn(n, shape.heads, d, device=device, dtype=shape.dtype)
    times = []
    for i in range(WARMUP + REPEATS):
        if deadline is not None and time.perf_counter() > deadline:
            raise OutOfTime()
        fn = _kernel(plans[max(0, i - WARMUP)], backend)
        _sync(device)
        start = time.perf_counter()
        torch.autograd.grad(fn(*qkv), qkv, grad)
        _sync(device)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
            if limit is not None and times[-1] > limit:
                raise Lost(times[-1])
    return statistics.median(times)


class OutOfMemory(Exception):
    """A trial that ran out of the device's memory."""


def trial(
    backend: Backend,
    device: torch.device,
    shape: Shape,
    limit: float | None = None,
    deadline: float | None = None,
) -> float | str:
    """``backend``'s `timing`, or why it is not timed (it raises, it lost, the time is up);
    `OutOfMemory` where the device's memory ran out (the choice tries fewer rows)."""
    try:
        return timing(backend, device, shape, limit, deadline)
    except Lost as lost:
        return f"slower ({1e3 * lost.seconds:.2f} ms on one call, over {SLOWER:g}x the fastest)"
    except OutOfTime:
        return f"not timed (the choice's {CHOICE_SECONDS:g} s were spent)"
    except torch.cuda.OutOfMemoryError as exc:
        raise OutOfMemory() from exc
    except Exception as exc:  # a kernel that refuses this device or shape
        return _failed(exc)


def _failed(exc: Exception) -> str:
    return f"failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


@dataclass(frozen=True)
class Choice:
    """The backend a run takes and its banner line."""

    backend: Backend
    line: str


def _timed(
    found: list[Backend], device: torch.device, shape: Shape, measure: Callable, start: float
) -> tuple[dict[str, float], dict[str, str]]:
    """Each of ``found`` measured in turn, each against the fastest median before it."""
    times: dict[str, float] = {}
    why: dict[str, str] = {}
    for backend in found:
        limit = SLOWER * min(times.values()) if times else None
        result = measure(backend, device, shape, limit, start + CHOICE_SECONDS)
        if isinstance(result, str):
            why[backend.name] = result
        else:
            times[backend.name] = result
    return times, why


def choose(
    device: torch.device,
    shape: Shape,
    request: str = "auto",
    measure: Callable[..., float | str] | None = None,
    check: Callable[[Backend, torch.device, Shape], str | None] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Choice:
    """The backend for ``request`` (a name, or ``auto``: the fastest of the candidates, each
    timed by ``measure`` (default `trial`), that ``check`` (default `inexact`) finds exact)."""
    measure, check = measure or trial, check or inexact
    if request != "auto":
        ok, why = backends.available(device, shape.dtype, shape.head_dim)
        if request in why:
            raise _refused(request, why[request], [b.name for b in ok])
        return Choice(backends.BACKENDS[request], f"attention: {request} (--attention {request})")
    found, why = backends.candidates(device, shape.dtype, shape.head_dim)
    if len(found) == 1 and found[0].name in backends.FALLBACKS:
        return Choice(found[0], varlen.describe(device, shape.dtype, shape.head_dim))
    start, notes = clock(), []
    while True:
        try:
            times, failed = _timed(found, device, shape, measure, start)
            break
        except OutOfMemory:
            if shape.rows == 1:
                why |= dict.fromkeys((b.name for b in found), "out of memory at 1 row")
                times, failed = {}, {}
                break
            notes.append(f"out of memory at {shape.rows} rows")
            shape = replace(shape, rows=shape.rows // 2)
            _free(device)
    why |= failed
    best = None
    for name in sorted(times, key=lambda name: (times[name], backends.ORDER.index(name))):
        problem = check(backends.BACKENDS[name], device, shape)
        if problem is None:
            best = name
            break
        why[name], times = problem, {k: v for k, v in times.items() if k != name}
    took = f"chosen in {clock() - start:.1f} s"
    where = f"{shape.rows} x {shape.seq_length}" + "".join(f", {n}" for n in notes)
    if best is None:
        fallback = backends.BACKENDS["sdpa"]
        return Choice(fallback, f"attention: sdpa fallback, slower: {_reasons(why)} ({took})")
    timed = ", ".join(f"{name} {1e3 * s:.2f} ms" for name, s in times.items())
    line = f"attention: {best}, the fastest exact of {timed} "
    line += f"(forward + backward at {where}; {took})"
    left = {name: reason for name, reason in why.items() if name not in backends.FALLBACKS}
    return Choice(backends.BACKENDS[best], line + (f"; {_reasons(left)}" if left else ""))


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def check(request: str, device: torch.device) -> None:
    """A UserError where the backend ``request`` names cannot run on ``device`` at all (before
    any data is read; its dtype and head size are checked when the model is built)."""
    problem = None if request == "auto" else backends.BACKENDS[request].probe(device)
    if problem is not None:
        ok = [b.name for b in backends.BACKENDS.values() if b.probe(device) is None]
        raise _refused(request, problem, ok)


def _refused(request: str, problem: str, available: list[str]) -> UserError:
    return UserError(f"--attention {request}: {problem} (available here: {', '.join(available)})")


def _reasons(why: dict[str, str]) -> str:
    return "; ".join(f"{name}: {reason}" for name, reason in why.items())


def take(
    device: torch.device,
    shape: Shape,
    request: str,
    share: Callable[[str], str] = lambda name: name,
) -> str:
    """Choose (`choose`; under torchrun ``share`` gives every rank rank 0's choice), take the
    backend for this process (`backends.use`) and return the banner line."""
    choice = choose(device, shape, request)
    name = share(choice.backend.name)
    try:
        backends.use(backends.BACKENDS[name], device)
    except Exception as exc:  # a named FA3/FA4 whose package cannot be loaded
        raise UserError(f"--attention {name}: {str(exc).splitlines()[0]}") from exc
    _LINES[device.type] = choice.line
    return choice.line


_LINES: dict[str, str] = {}  # device type -> the banner line of the backend `take` took


def banner(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """The run's banner line on its attention backend (`take`'s, else the default's)."""
    return _LINES.get(device.type) or varlen.describe(device, dtype, head_dim)
