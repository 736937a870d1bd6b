"""varlen.py: torch's flash varlen ops called by keyword as each torch release defines them (ops of
those schemas registered here), the fallback for a schema it does not know, and the banner line
that names the kernel a run gets and why."""

import importlib.util
import itertools
import sys
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llama_ddp.attention_plan import varlen
from llama_ddp.attention_plan.plan import flash_varlen_supported, plan_attention
from llama_ddp.model.attention import kernel_for, segment_attention
from llama_ddp.model.config import preset

Q = "Tensor query, Tensor key, Tensor value, Tensor cu_seq_q, Tensor{k} cu_seq_k, "
Q += "SymInt max_q, SymInt max_k, bool is_causal=False"
BACK = "Tensor grad_out, Tensor query, Tensor key, Tensor value, Tensor out, Tensor lse, "
BACK += "Tensor cu_seq_q, Tensor cu_seq_k, SymInt max_q, SymInt max_k, bool is_causal, "
BACK += "Tensor rng_state"
WINDOW = ", float? scale=None, SymInt[]? window_size=None"
GQA = ", bool enable_gqa=False, Tensor? seqused_k=None, Tensor? block_table=None, "
GQA += "SymInt? num_splits=None"
CACHE = ", Tensor? k_cache=None, Tensor? v_cache=None, Tensor? cache_seqlens=None, "
CACHE += "Tensor? cache_batch_idx=None, Tensor? page_table=None, Tensor? seqused_k=None"
# torch release -> (forward, backward) argument lists of torch_attn::_varlen_attn(_backward)
SCHEMAS = {
    "2.10": (Q.format(k=""), BACK),
    "2.11": (Q.format(k="") + WINDOW, BACK + WINDOW),
    "2.12": (Q.format(k="?") + WINDOW + GQA, BACK + WINDOW),
    "later, with k_cache": (Q.format(k="") + WINDOW + CACHE, BACK + WINDOW),
}
# The tests that run this torch's own varlen op (torch 2.10 and later; 2.9 has none).
needs_varlen = pytest.mark.skipif(
    importlib.util.find_spec("torch.nn.attention.varlen") is None,
    reason=f"torch {torch.__version__} has no torch.nn.attention.varlen (2.10 and later)",
)
RESULTS = " -> (Tensor, Tensor, Tensor)"
_libraries = []  # kept alive: a Library's ops go when it is collected
_count = itertools.count()


def register(forward: str, backward: str) -> tuple[object, object, list[dict]]:
    """Ops of these argument lists in a namespace of their own; each call's arguments by name
    are appended to the returned list (the dispatcher leaves out trailing ones at their
    defaults: those are filled in)."""
    ns = f"llama_ddp_test_varlen{next(_count)}"
    lib = torch.library.Library(ns, "DEF")
    _libraries.append(lib)
    calls = []
    for name, args in (("_varlen_attn", forward), ("_varlen_attn_backward", backward)):
        lib.define(f"{name}({args}){RESULTS}")
        schema = getattr(getattr(torch.ops, ns), name).default._schema

        def impl(*values, _schema=schema, _name=name):
            named = {a.name: a.default_value for a in _schema.arguments}
            named |= {a.name: v for a, v in zip(_schema.arguments, values)}
            calls.append({"op": _name, **named})
            q = named["query"]
            if _name == "_varlen_attn":
                lse = torch.full((q.shape[1], q.shape[0]), 7.0)
                return q * 2, lse, torch.zeros(2, dtype=torch.uint64)
            return q + 1, named["key"] + 1, named["value"] + 1

        lib.impl(name, impl, "CompositeExplicitAutograd")
    ops = getattr(torch.ops, ns)
    return ops._varlen_attn, ops._varlen_attn_backward, calls


def tensors(heads=4, kv_heads=2, n=6, d=8):
    q, k, v = (torch.randn(n, h, d) for h in (heads, kv_heads, kv_heads))
    return q, k, v, torch.tensor([0, 2, n], dtype=torch.int32)


@pytest.mark.parametrize("release", list(SCHEMAS))
def test_each_known_schema_is_called_by_keyword(release):
    forward_op, backward_op, calls = register(*SCHEMAS[release])
    ops = varlen.bind(forward_op, backward_op)
    assert isinstance(ops, varlen.VarlenOps), ops
    q, k, v, cu = tensors()
    out, lse = ops.forward(q, k, v, cu, 4)
    assert torch.equal(out, q * 2) and lse.shape == (4, 6)
    dq, dk, dv = ops.backward(out, q, k, v, out, lse, cu, 4)
    assert torch.equal(dq, q + 1) and torch.equal(dk, k + 1) and torch.equal(dv, v + 1)
    forward, backward = calls
    given = {"query": q, "key": k, "value": v, "cu_seq_q": cu, "cu_seq_k": cu}
    for name, value in given.items():
        assert forward[name] is value and backward[name] is value, name
    assert backward["grad_out"] is out and backward["out"] is out and backward["lse"] is lse
    for call in (forward, backward):
        assert (call["max_q"], call["max_k"], call["is_causal"]) == (4, 4, True)
        assert call.get("window_size", [-1, 0]) == [-1, 0]  # causal, where there is a window
        assert call.get("scale") is None  # 1 / sqrt(head dim)
    assert forward.get("enable_gqa", True) is True  # 4 query heads over 2 key/value heads
    rest = set(forward) - set(given) - {"op", "max_q", "max_k", "is_causal", "window_size"}
    assert all(forward[name] is None for name in rest - {"enable_gqa"})  # at their defaults
    assert torch.equal(backward["rng_state"], torch.zeros(2, dtype=torch.uint64))


def test_enable_gqa_is_false_when_the_heads_are_as_many():
    forward_op, backward_op, calls = register(*SCHEMAS["2.12"])
    q, k, v, cu = tensors(heads=2)
    varlen.bind(forward_op, backward_op).forward(q, k, v, cu, 4)
    assert calls[0]["enable_gqa"] is False


@needs_varlen
def test_the_installed_torch_has_a_known_schema():
    assert isinstance(varlen.installed(), varlen.VarlenOps), varlen.installed()


UNKNOWN = {
    "a new argument, even with a default": (
        SCHEMAS["2.12"][0] + ", float softcap=0.0",
        SCHEMAS["2.12"][1],
        "its torch_attn_new::_varlen_attn has an argument 'softcap' that llama_ddp does not know",
    ),
    "a renamed one": (
        SCHEMAS["2.11"][0].replace("is_causal", "causal"),
        SCHEMAS["2.11"][1],
        "an argument 'causal'",
    ),
    "a required one we do not give": (
        SCHEMAS["2.11"][0].replace("SymInt max_k, ", "SymInt max_k, Tensor? seqused_k, "),
        SCHEMAS["2.11"][1],
        "has no default for 'seqused_k'",
    ),
    "a new argument of the backward": (
        SCHEMAS["2.11"][0],
        SCHEMAS["2.11"][1] + ", Tensor? dlse=None",
        "_varlen_attn_backward has an argument 'dlse'",
    ),
}


@pytest.mark.parametrize("case", list(UNKNOWN))
def test_a_schema_it_does_not_know_is_not_bound(case):
    forward, backward, expected = UNKNOWN[case]
    forward_op, backward_op, calls = register(forward, backward)
    reason = varlen.bind(forward_op, backward_op)
    assert isinstance(reason, str)
    assert expected.replace("torch_attn_new", forward_op._qualified_op_name.split("::")[0]) in (
        reason
    ), reason
    assert calls == []


@pytest.fixture
def gpu(monkeypatch):
    """A CUDA device as seen by varlen.py: an H100 (compute capability 9.0) unless changed."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: capability["value"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Tesla T4")
    return capability


BF16, FP32 = torch.bfloat16, torch.float32


@needs_varlen
def test_the_banner_names_the_kernel_and_for_the_fallback_why_and_what_gives_flash(
    gpu, monkeypatch
):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    version = torch.__version__
    assert varlen.describe(cpu, FP32, 64) == (
        "attention: the CPU flash kernel on documents bucketed into grids"
    )
    assert varlen.describe(cuda, BF16, 64) == f"attention: flash varlen (torch {version}, sm 9.0)"
    tail = "; its backward holds up to 256 MB of fp32 probabilities at a time"
    assert varlen.describe(cuda, FP32, 64) == (
        "attention: sdpa fallback, slower: float32 on CUDA (flash computes in bf16 or fp16) "
        f"(for flash varlen: --dtype bf16){tail}"
    )
    assert varlen.describe(cuda, BF16, 12) == (
        "attention: sdpa fallback, slower: head dim 12 (flash takes a multiple of 8, at most "
        "256) (for flash varlen: a hidden size and head count whose quotient is a multiple of "
        f"8, at most 256){tail}"
    )
    gpu["value"] = (7, 5)
    assert varlen.describe(cuda, BF16, 64) == (
        "attention: sdpa fallback, slower: Tesla T4 is compute capability 7.5 (for flash "
        "varlen: a GPU of compute capability 8.0 or newer (A100, L4, H100, RTX 30xx and "
        f"later)){tail}"
    )
    gpu["value"] = (8, 0)
    old = varlen.Fallback("torch 2.9.0 has no flash varlen attention", varlen._NEWER_TORCH)
    monkeypatch.setattr(varlen, "installed", lambda: old)
    assert varlen.describe(cuda, BF16, 64) == (
        "attention: sdpa fallback, slower: torch 2.9.0 has no flash varlen attention (for flash "
        f"varlen: torch 2.10 to 2.13 (e.g. TORCH_VERSION=2.13.0 make install)){tail}"
    )


@pytest.fixture
def rebind():
    """`varlen.installed` looks again, and again after the test (its answer is cached)."""
    varlen.installed()  # torch's module is imported: its ops are registered
    varlen.installed.cache_clear()
    yield varlen.installed
    varlen.installed.cache_clear()


@needs_varlen
def test_a_torch_whose_schema_it_does_not_know_falls_back(gpu, monkeypatch, rebind):
    cuda = torch.device("cuda", 0)
    forward_op, _, _ = register(*UNKNOWN["a new argument, even with a default"][:2])
    monkeypatch.setattr(torch.ops.torch_attn, "_varlen_attn", forward_op)
    kernel, problem = varlen.choose(cuda, BF16, 64)
    assert kernel == "sdpa"
    assert problem.why.startswith(f"torch {torch.__version__}: its ")
    assert "'softcap' that llama_ddp does not know" in problem.why
    assert problem.remedy.endswith(", or report it")
    assert not flash_varlen_supported(cuda)  # the plan's check: the kernel is not varlen
    monkeypatch.undo()
    rebind.cache_clear()
    assert varlen.installed().forward_op is torch.ops.torch_attn._varlen_attn


def test_a_torch_without_the_op_falls_back(gpu, monkeypatch, rebind):
    """torch 2.9 (2.9.0, 2.9.1): no torch.nn.attention.varlen."""
    monkeypatch.setitem(sys.modules, "torch.nn.attention.varlen", None)  # import fails
    kernel, problem = varlen.choose(torch.device("cuda", 0), BF16, 64)
    assert kernel == "sdpa"
    assert problem.why == f"torch {torch.__version__} has no flash varlen attention"
    assert not flash_varlen_supported(torch.device("cuda", 0))


@pytest.mark.parametrize(
    "dtype, head_dim, flash", [(BF16, 64, True), (torch.float16, 8, True), (FP32, 64, True),
                               (BF16, 12, True), (BF16, 264, True), (BF16, 64, False)]
)  # fmt: skip
def test_the_banner_and_the_kernel_agree(gpu, dtype, head_dim, flash):
    if not flash:
        gpu["value"] = (7, 0)
    plan = plan_attention((1, 8))
    plan.kernel = "varlen" if varlen.device_problem(torch.device("cuda", 0)) is None else "sdpa"
    q = torch.empty(8, 4, head_dim, dtype=dtype, device="meta")
    assert kernel_for(q, plan) == varlen.choose(torch.device("cuda", 0), dtype, head_dim)[0]


@pytest.mark.parametrize("hip, shape", [(None, (4, 6)), ("6.2", (2, 4, 5))])
def test_the_fake_log_sum_exp_has_the_shape_torch_gives_on_cuda_and_rocm(hip, shape, monkeypatch):
    """torch.compile traces segment_attention through its fake: on ROCm flash pads the
    log-sum-exp per segment, (segments, H, max_seqlen), as torch's own fake of the op says."""
    monkeypatch.setattr(torch.version, "hip", hip)
    plan = plan_attention((2, 3))
    with FakeTensorMode(allow_non_fake_inputs=True):  # the plan's host tensors stay real
        q, k, v = torch.empty(6, 4, 8), torch.empty(6, 2, 8), torch.empty(6, 2, 8)
        cu = torch.tensor([0, 1, 6], dtype=torch.int32)
        out, lse, *_ = segment_attention(
            q, k, v, cu, 5, plan.grids, plan.slots, plan.padding, "varlen"
        )
    assert out.shape == (6, 4, 8) and lse.shape == shape and lse.dtype == torch.float32


def test_segment_attention_calls_the_ops_through_the_binding(monkeypatch):
    """attention.py's varlen kernel, forward and backward, calls whatever `installed` bound (here
    ops of torch 2.10's schema, on the CPU)."""
    forward_op, backward_op, calls = register(*SCHEMAS["2.10"])
    monkeypatch.setattr(varlen, "installed", lambda: varlen.bind(forward_op, backward_op))
    q, k, v, cu = tensors()
    q.requires_grad_()
    plan = plan_attention((1, 6))
    out, lse, *_ = segment_attention(q, k, v, cu, 4, plan.grids, plan.slots, plan.padding, "varlen")
    out.sum().backward()
    assert [c["op"] for c in calls] == ["_varlen_attn", "_varlen_attn_backward"]
    assert torch.equal(out, q * 2) and torch.equal(q.grad, q.detach() + 1)


@needs_varlen
def test_the_run_banner_names_the_attention_kernel(gpu):
    """Its last start-up line, from the run's device, compute dtype and the model's head dim."""
    from llama_ddp.train.config import TrainConfig
    from llama_ddp.train.run import describe

    def banner(device: str, hidden_size: int) -> str:
        config = preset("tiny", vocab_size=300, hidden_size=hidden_size)  # 4 heads
        model = SimpleNamespace(config=config, num_parameters=lambda: 100_000)
        data = SimpleNamespace(
            describe=lambda: "packed sequences",
            sampler=SimpleNamespace(micro_batch=8, accum_steps=1),
            special=SimpleNamespace(describe=lambda: "BOT <- [BOT] (0)"),
        )
        trainer = SimpleNamespace(
            model=model, data=data, state=SimpleNamespace(step=0, budget=None), total_steps=8,
            micro_batch_note=None, compile_note="compile: off (--no-compile)",
            precision=SimpleNamespace(dtype=BF16, describe=lambda: "precision: bf16"),
            schedule=SimpleNamespace(current=SimpleNamespace(lr=4e-3)),
        )  # fmt: skip
        rt = SimpleNamespace(mode="single", world_size=1, device=torch.device(device))
        cfg = TrainConfig.from_flags(batch_size=8, optimizer="muon", lr_schedule="wsd")
        lines = describe(cfg, rt, trainer)
        assert lines[2] == "optimizer: muon, peak lr 0.004 (wsd)"
        assert lines[-2] == "compile: off (--no-compile)"  # the build's decision, not a new one
        return lines[-1]

    assert banner("cpu", 64) == "attention: the CPU flash kernel on documents bucketed into grids"
    assert banner("cuda", 64) == f"attention: flash varlen (torch {torch.__version__}, sm 9.0)"
    assert banner("cuda", 72).startswith("attention: sdpa fallback, slower: head dim 18 (")
