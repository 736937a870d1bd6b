"""kernel_choice.py: --attention, the fastest exact backend. The choice runs with the device's
candidates and their timings mocked (no GPU here); the exactness check and the timing run for
real on the CPU's kernels."""

import pytest
import torch
import torch.nn.functional as F

from llama_ddp.attention_plan import backends, varlen
from llama_ddp.attention_plan.plan import plan_attention
from llama_ddp.errors import UserError
from llama_ddp.model import kernel_choice
from llama_ddp.model.kernel_choice import Shape

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
SHAPE = Shape(torch.bfloat16, 12, 4, 64, 8, 1024)
B = backends.BACKENDS


@pytest.fixture
def hopper(monkeypatch):
    """A device whose candidates are flash-varlen, fa3 and cudnn (sdpa its fallback)."""
    fast = [B["flash-varlen"], B["fa3"], B["cudnn"]]
    why = {"fa4": "not installed (pip install flash-attn-4)", "grids": "needs CPU"}
    monkeypatch.setattr(backends, "candidates", lambda *a: (list(fast), dict(why)))
    monkeypatch.setattr(backends, "_IN_USE", {})
    monkeypatch.setattr(kernel_choice, "_LINES", {})


def timer(times: dict, limits: list | None = None, oom_above: int = 1 << 30):
    """A mocked trial: ``times[name]`` (seconds, or why not timed); `OutOfMemory` at more
    rows than ``oom_above``; the limit each trial was given appended to ``limits``."""

    def measure(backend, device, shape, limit, deadline):
        assert device == CUDA and shape.seq_length == SHAPE.seq_length
        if shape.rows > oom_above:
            raise kernel_choice.OutOfMemory()
        if limits is not None:
            limits.append((backend.name, limit, shape.rows))
        return times[backend.name]

    return measure


def exact(*args):
    return None


def clock(*readings):
    it = iter(readings)
    return lambda: next(it)


def test_auto_takes_the_fastest_exact_backend_and_says_what_it_measured(hopper):
    limits = []
    times = {"flash-varlen": 2.5e-3, "fa3": 1.9e-3, "cudnn": 2.1e-3}
    choice = kernel_choice.choose(
        CUDA, SHAPE, measure=timer(times, limits), check=exact, clock=clock(100.0, 103.25)
    )
    assert choice.backend.name == "fa3"
    assert choice.line == (
        "attention: fa3, the fastest exact of flash-varlen 2.50 ms, fa3 1.90 ms, cudnn 2.10 ms "
        "(forward + backward at 8 x 1024; chosen in 3.2 s); fa4: not installed (pip install "
        "flash-attn-4)"
    )
    # each trial may take at most SLOWER x the fastest median before it
    assert limits == [("flash-varlen", None, 8), ("fa3", 7.5e-3, 8), ("cudnn", 3 * 1.9e-3, 8)]


def test_a_backend_that_fails_loses_or_errs_is_passed_over_with_its_reason(hopper):
    times = {"flash-varlen": 2.5e-3, "fa3": "failed (RuntimeError: FA3 refuses)", "cudnn": 1e-3}
    checked = []

    def check(backend, device, shape):
        checked.append(backend.name)
        return "not exact (dq off by 0.5 > 0.002)" if backend.name == "cudnn" else None

    choice = kernel_choice.choose(CUDA, SHAPE, measure=timer(times), check=check)
    assert choice.backend.name == "flash-varlen"
    assert checked == ["cudnn", "flash-varlen"]  # the fastest first, until one is exact
    assert "fa3: failed (RuntimeError: FA3 refuses)" in choice.line
    assert "cudnn: not exact (dq off by 0.5 > 0.002)" in choice.line
    assert "the fastest exact of flash-varlen 2.50 ms (" in choice.line
    every = dict.fromkeys(times, "slower (9.00 ms on one call, over 3x the fastest)")
    choice = kernel_choice.choose(CUDA, SHAPE, measure=timer(every), check=exact)
    assert choice.backend.name == "sdpa"
    assert choice.line.startswith("attention: sdpa fallback, slower: fa4: not installed")


def test_equal_times_go_to_the_earlier_backend_in_order(hopper):
    times = dict.fromkeys(B, 1e-3)
    choice = kernel_choice.choose(CUDA, SHAPE, measure=timer(times), check=exact)
    assert choice.backend.name == "flash-varlen"


def test_a_trial_out_of_memory_is_tried_again_at_half_the_rows_and_named(hopper):
    """A tight card: every backend is timed again at fewer rows, not passed over (issue 53,
    item 8: before, an out-of-memory was a 'failed' backend and the run took sdpa)."""
    limits = []
    times = {"flash-varlen": 2.5e-3, "fa3": 1.9e-3, "cudnn": 2.1e-3}
    shape = Shape(torch.bfloat16, 12, 4, 64, 16, 1024)
    measure = timer(times, limits, oom_above=4)
    choice = kernel_choice.choose(CUDA, shape, measure=measure, check=exact)
    assert choice.backend.name == "fa3"
    assert {rows for _, _, rows in limits} == {4}
    assert (
        "(forward + backward at 4 x 1024, out of memory at 16 rows, out of memory at 8 rows;"
        in (choice.line)
    )
    nothing = kernel_choice.choose(CUDA, shape, measure=timer(times, oom_above=0), check=exact)
    assert nothing.backend.name == "sdpa"
    assert "flash-varlen: out of memory at 1 row" in nothing.line


def test_a_trial_stops_a_backend_that_lost_or_ran_out_of_time_and_names_out_of_memory(
    monkeypatch,
):
    shape = Shape(torch.float32, 4, 2, 16, 2, 64)
    assert kernel_choice.trial(B["grids"], CPU, shape, limit=0.0).startswith("slower (")
    past = kernel_choice.time.perf_counter() - 1
    assert kernel_choice.trial(B["grids"], CPU, shape, deadline=past) == (
        "not timed (the choice's 20 s were spent)"
    )

    def out_of_memory(plan, backend):
        def attend(q, k, v):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")

        return attend

    monkeypatch.setattr(kernel_choice, "_kernel", out_of_memory)
    with pytest.raises(kernel_choice.OutOfMemory):
        kernel_choice.trial(B["grids"], CPU, shape)


def test_torch_that_cannot_undo_fa3_or_fa4_never_tries_them(monkeypatch):
    """torch 2.10: activate_flash_attention_impl but no restore_flash_attention_impl (issue 53,
    item 2): a trial of FA4 would leave every later kernel on FA4."""
    ok = [B["flash-varlen"], B["fa3"], B["fa4"], B["cudnn"], B["sdpa"]]
    monkeypatch.setattr(backends, "available", lambda *a: (list(ok), {"grids": "needs CPU"}))
    monkeypatch.setattr(backends, "undoable", lambda: False)
    found, why = backends.candidates(CUDA, torch.bfloat16, 64)
    assert [b.name for b in found] == ["flash-varlen", "cudnn"]
    assert why["fa4"].endswith(
        "cannot undo its activation, so auto does not try it (torch 2.11 or later can; "
        "--attention fa4 takes it)"
    )
    monkeypatch.setattr(backends, "undoable", lambda: True)
    found, _ = backends.candidates(CUDA, torch.bfloat16, 64)
    assert [b.name for b in found] == ["flash-varlen", "fa3", "fa4", "cudnn"]


def test_activating_torchs_own_kernel_where_fa4_cannot_be_undone_is_said(monkeypatch):
    attention = torch.nn.attention
    monkeypatch.setattr(attention, "current_flash_attention_impl", lambda: "FA4", raising=False)
    monkeypatch.delattr(attention, "restore_flash_attention_impl", raising=False)
    with pytest.raises(RuntimeError, match="cannot undo an activated flash kernel"):
        backends.activate(B["flash-varlen"])


def test_exactness_is_checked_at_the_runs_own_sequence_length(monkeypatch):
    """A kernel wrong only on long rows (issue 53, item 10): the 4 x 256 documents pass, the
    run's own 1024-token layout does not."""
    shape = Shape(torch.float32, 4, 2, 16, 2, 1024)
    assert [p is None for p in kernel_choice.exactness_plans(shape)] == [True, False]
    assert kernel_choice.exactness_plans(shape)[1].shape == (2, 1024)
    assert len(kernel_choice.exactness_plans(Shape(torch.float32, 4, 2, 16, 2, 256))) == 1
    real = kernel_choice._kernel

    def wrong_on_long_rows(plan, backend):
        fn = real(plan, backend)
        return lambda q, k, v: fn(q, k, v) * (1.5 if plan.max_seqlen > 256 else 1.0)

    assert kernel_choice.inexact(B["grids"], CPU, shape) is None
    monkeypatch.setattr(kernel_choice, "_kernel", wrong_on_long_rows)
    assert kernel_choice.inexact(B["grids"], CPU, shape).startswith("not exact (out off by ")


def test_a_named_backend_is_taken_unmeasured_or_refused_in_one_line(monkeypatch):
    def never(*args):
        raise AssertionError("a named backend is not measured")

    monkeypatch.setattr(backends, "_IN_USE", {})
    choice = kernel_choice.choose(CPU, SHAPE, "grids", measure=never)
    assert (choice.backend.name, choice.line) == ("grids", "attention: grids (--attention grids)")
    with pytest.raises(UserError) as err:
        kernel_choice.choose(CPU, SHAPE, "cudnn", measure=never)
    assert str(err.value) == "--attention cudnn: needs CUDA (available here: grids)"
    choice = kernel_choice.choose(CPU, Shape(torch.float32, 4, 2, 16, 2, 64), measure=never)
    assert choice.backend.name == "grids"  # one candidate: nothing to measure
    assert choice.line == varlen.describe(CPU, torch.float32, 16)


def test_every_rank_takes_rank_0s_backend_and_the_banner_says_it(hopper, monkeypatch):
    monkeypatch.setattr(kernel_choice, "trial", lambda *a: 1.0)  # a tie: flash-varlen
    monkeypatch.setattr(kernel_choice, "inexact", exact)
    activated = []
    monkeypatch.setattr(backends, "activate", activated.append)
    line = kernel_choice.take(CUDA, SHAPE, "auto", share=lambda name: "cudnn")  # rank 0's
    assert activated == [B["cudnn"]] and backends.current_kernel(CUDA) == "cudnn"
    assert kernel_choice.banner(CUDA, torch.bfloat16, 64) == line
    assert line.startswith("attention: flash-varlen, the fastest exact of")  # this rank's own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_kernels_are_exact_and_a_leaking_one_is_not(dtype, monkeypatch):
    """errors(): the CPU's grids and sdpa kernels within their tolerance (the rule of
    test_gpu.py's attention test) in fp32 and bf16; a kernel that lets documents see each other
    (one causal attention over each whole row) is off by far more, and `trial` says so."""
    shape = Shape(dtype, 4, 2, 16, 2, 64)
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([30, 50, 48])).view(2, 64)
    padded = plan_attention((2, 64), torch.arange(64) < torch.tensor([[64], [40]]), ids)
    for name in ("grids", "sdpa"):
        for plan in (None, padded):  # EXACT_LENGTHS' documents; documents and padding
            found = kernel_choice.errors(B[name], CPU, shape, plan)
            for what, (error, tolerance) in found.items():
                assert error <= tolerance, (name, what, error, tolerance)

    def leaking(plan, backend):
        def attend(q, k, v):
            rows = [x.view(4, -1, *x.shape[1:]).transpose(1, 2) for x in (q, k, v)]
            out = F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True)
            return out.transpose(1, 2).reshape(q.shape)

        return attend

    monkeypatch.setattr(kernel_choice, "_kernel", leaking)
    result = kernel_choice.inexact(B["grids"], CPU, shape)
    assert result.startswith("not exact (out off by ")


def test_a_kernel_that_raises_is_passed_over_and_timing_measures_the_kernel(monkeypatch):
    shape = Shape(torch.float32, 4, 2, 16, 2, 64)
    seconds = kernel_choice.timing(B["grids"], CPU, shape)
    assert 0 < seconds < 10

    def refusing(plan, backend):
        def attend(q, k, v):
            raise RuntimeError("FA3 requires compute capability 9.0\nmore")

        return attend

    monkeypatch.setattr(kernel_choice, "_kernel", refusing)
    result = kernel_choice.trial(B["grids"], CPU, shape)
    assert result == "failed (RuntimeError: FA3 requires compute capability 9.0)"
    assert kernel_choice.inexact(B["grids"], CPU, shape) == result


def test_timing_meets_a_new_layout_at_each_call_and_exactness_references_torchs_own_kernels(
    monkeypatch,
):
    """The timed calls run on layouts of their own (a kernel that builds per shape pays as in
    training); the references of the exactness check run before the backend is activated (FA3
    and FA4 replace torch's flash kernels for the whole process)."""
    plans = kernel_choice.layouts(4, 128, 5)
    grids = {tuple(map(tuple, p.grids.tolist())) for p in plans}
    assert len(grids) == 5 and plans[0].grids.tolist() == [[4, 128, 512]]
    for plan in plans:
        assert plan.cu_seqlens[-1] == 512 and plan.max_seqlen >= 16
    events = []
    monkeypatch.setattr(backends, "activate", lambda b: events.append(f"activate {b.name}"))
    real = kernel_choice._reference
    monkeypatch.setattr(
        kernel_choice,
        "_reference",
        lambda *a, math: events.append(f"ref {math}") or real(*a, math=math),
    )
    kernel_choice.errors(B["grids"], CPU, Shape(torch.float32, 4, 2, 16, 2, 64))
    assert events == ["activate sdpa", "ref True", "ref False", "activate grids"]


def test_a_named_backend_that_cannot_be_activated_is_one_line(monkeypatch):
    def broken(backend):
        raise RuntimeError("Module 'flash_attn_interface' does not expose FA3 kernels\ndetails")

    monkeypatch.setattr(backends, "activate", broken)
    monkeypatch.setattr(backends, "_IN_USE", {})
    monkeypatch.setattr(kernel_choice, "choose", lambda *a: kernel_choice.Choice(B["fa3"], ""))
    with pytest.raises(UserError) as err:
        kernel_choice.take(CUDA, SHAPE, "fa3")
    assert (
        str(err.value)
        == "--attention fa3: Module 'flash_attn_interface' does not expose FA3 kernels"
    )
