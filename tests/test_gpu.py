"""CUDA paths the CPU suite cannot run: skipped on a machine without a GPU (make test-gpu)."""

import pytest
import torch

from llama_ddp.distributed import runtime as D
from llama_ddp.distributed.parallelize import build_model, parallelize
from llama_ddp.model.config import preset
from llama_ddp.precision import Precision
from tests.helpers.runs import load_weights, max_diff, run_train, tiny_args

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")


def cuda_args(train_env, out, *extra):
    return [*tiny_args(train_env, out, *extra), "--device", "cuda"]


@pytest.fixture(scope="module")
def bf16_reference(train_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bf16")
    result = run_train(train_env, cuda_args(train_env, out, "--dtype", "bf16", "--no-compile"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


@pytest.mark.e2e
def test_single_gpu_bf16_training_learns(bf16_reference):
    import json

    records = [json.loads(line) for line in (bf16_reference / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.3 and all(loss == loss for loss in losses)


@pytest.mark.e2e
def test_compile_on_gpu_matches_eager(bf16_reference, train_env, tmp_path):
    args = cuda_args(train_env, tmp_path, "--dtype", "bf16", "--compile")
    assert run_train(train_env, args).returncode == 0
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2  # bf16 kernels


@two_gpus
def test_data_parallel_replicas_compute_in_bf16():
    model = build_model(preset("tiny", vocab_size=64), 0, torch.device("cuda", 0))
    precision = Precision(torch.bfloat16, torch.device("cuda", 0))
    rt = D.Runtime("dp", torch.device("cuda", 0), replicas=GPUS)
    wrapped = parallelize(model, rt, precision)
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with precision.autocast():
        wrapped(torch.randint(0, 64, (2 * GPUS, 16), device="cuda"))
    assert len(seen) == GPUS and set(seen) == {torch.bfloat16}


@pytest.mark.e2e
@two_gpus
def test_data_parallel_training_matches_one_gpu(bf16_reference, train_env, tmp_path):
    result = run_train(train_env, cuda_args(train_env, tmp_path, "--dtype", "bf16", "--mode", "dp"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["single", "ddp", "fsdp"])
@pytest.mark.parametrize(
    "layout",
    [
        ["--packing", "pack", "--no-compile"],  # documents kept apart: the varlen kernel
        ["--packing", "pad", "--no-compile"],  # padded rows: only the real positions
        ["--packing", "pack", "--activation-checkpointing", "--compile"],
        ["--packing", "pad", "--activation-checkpointing", "--compile"],
    ],
    ids=["pack", "pad", "pack-ac-compile", "pad-ac-compile"],
)
def test_training_steps_do_not_synchronize(mode, layout, train_env, tmp_path):
    """Three training steps under torch.cuda.set_sync_debug_mode("error")
    (tests/helpers/gpu_steps.py), bf16: a host read or a blocking copy anywhere in a step fails
    it. DDP and FSDP under torchrun with one process: the wrappers' own input handling included."""
    import subprocess
    import sys

    from tests.helpers.runs import ROOT

    args = [*cuda_args(train_env, tmp_path, "--dtype", "bf16", *layout), "--mode", mode]
    args += ["--micro-batch-size", "4", "--cache-dir", str(train_env["root"] / "cache")]
    script = str(ROOT / "tests" / "helpers" / "gpu_steps.py")
    cmd = [sys.executable, script]
    if mode != "single":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += ["--nproc_per_node=1", script]
    env = {**train_env["env"], "PYTHONPATH": str(ROOT)}
    result = subprocess.run([*cmd, *args], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert f"{mode}: 3 steps without a synchronization" in result.stdout


def test_varlen_attention_equals_exact_attention_within_bf16s_own_error():
    """The CUDA kernel (flash varlen, bf16) on documents and on padded rows, forward and
    gradients, against exact attention (float64) of the same bf16 inputs, within twice the error
    of bf16 SDPA on each document (a fixed tolerance failed on torch 2.11: 2 elements of 196,608
    0.0213 apart, bf16 rounding, not a kernel fault)."""
    from llama_ddp.attention_plan.backends import BACKENDS
    from llama_ddp.attention_plan.plan import plan_attention
    from llama_ddp.model.kernel_choice import Shape, errors

    lengths = [[5, 200, 51], [256], [1, 18, 3, 234], [90, 166]]
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    )
    real = torch.arange(256) < torch.tensor([[256], [200], [150], [256]])
    for plan in (plan_attention(ids.shape, document_ids=ids), plan_attention(ids.shape, real, ids)):
        assert plan.to(torch.device("cuda")).kernel == "varlen"  # a moved plan's default
        shape = Shape(torch.bfloat16, 12, 3, 64, 4, 256)  # grouped-query attention
        found = errors(BACKENDS["flash-varlen"], torch.device("cuda"), shape, plan)
        for name, (error, tolerance) in found.items():
            assert error <= tolerance, f"{name}: {error:.4g} > {tolerance:.4g}"


def test_every_attention_backend_here_is_exact_or_passed_over_and_auto_takes_one():
    """Each fast backend this GPU runs (flash-varlen; cudnn on SM 9.0+; fa3, fa4 where their
    packages are installed) is exact within bf16's own error (kernel_choice.errors), or refuses
    the device or shape and is passed over, saying why; never inexact. flash-varlen is always
    exact; --attention auto takes one of the exact ones and its line names the times."""
    from llama_ddp.attention_plan import backends
    from llama_ddp.model import kernel_choice

    device = torch.device("cuda")
    shape = kernel_choice.Shape(torch.bfloat16, 12, 4, 64, 8, 1024)  # the base preset's heads
    found, why = backends.candidates(device, torch.bfloat16, 64)
    print("left out:", why)
    exact = []
    try:
        for backend in found:
            problem = kernel_choice.inexact(backend, device, shape)
            print(backend.name, problem, kernel_choice.trial(backend, device, shape))
            assert not str(problem).startswith("not exact"), (backend.name, problem)
            if problem is None:
                exact.append(backend.name)
        assert "flash-varlen" in exact
        choice = kernel_choice.choose(device, shape)
        print(choice.line)
        assert choice.backend.name in exact and "the fastest exact of" in choice.line
    finally:
        backends.activate(backends.BACKENDS["flash-varlen"])  # torch's own flash again


def test_one_attention_kernel_per_layer_forward():
    """A forward of a packed batch launches one flash varlen kernel per decoder layer (before:
    one SDPA kernel per grid width per layer, plus the copies into and out of the grids)."""
    from torch.profiler import ProfilerActivity, profile

    from llama_ddp.attention_plan.plan import plan_attention

    config = preset("small", vocab_size=512)
    model = build_model(config, 0, torch.device("cuda"))
    lengths = [[5, 200, 51], [256], [1, 18, 3, 234], [90, 166]]
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    )
    plan = plan_attention(ids.shape, document_ids=ids).to(torch.device("cuda"))
    x = torch.randint(0, 512, ids.shape, device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model(x, plan=plan)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(x, plan=plan)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    # (a split-KV forward would add its combine kernel: the work of the same call)
    attention = [k for k in kernels if "flash" in k.lower() and "combine" not in k.lower()]
    assert len(attention) == config.num_hidden_layers, attention


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_all_gpus_under_torchrun_match_one_gpu(mode, bf16_reference, train_env, tmp_path):
    """DDP and FSDP2 over every visible GPU (NCCL), bf16 autocast (FSDP: bf16 compute, fp32
    master weights and reduction): the weights of one GPU to bf16 tolerance (5e-2 after 8 steps:
    bf16 matmuls round differently with other batch splits)."""
    args = cuda_args(train_env, tmp_path, "--dtype", "bf16", "--mode", mode, "--no-compile")
    result = run_train(train_env, args, ["--standalone", f"--nproc_per_node={GPUS}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"mode {mode} x{GPUS}" in result.stdout
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_muon_in_bf16_on_gpus_matches_one_gpu(mode, train_env, tmp_path):
    """Muon in a bf16 run orthogonalizes in bf16 (native on the GPU), batched, each rank its
    share (NCCL: DDP's all-gather, FSDP's all-to-all of the stacked shards): DDP and FSDP over
    every visible GPU reach one GPU's weights to bf16 tolerance (5e-2, as AdamW's)."""
    one = tmp_path / "one"
    muon = ["--dtype", "bf16", "--optimizer", "muon"]
    assert run_train(train_env, cuda_args(train_env, one, *muon)).returncode == 0
    args = cuda_args(train_env, tmp_path / mode, *muon, "--mode", mode)
    result = run_train(train_env, args, ["--standalone", f"--nproc_per_node={GPUS}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer: muon" in result.stdout and f"mode {mode} x{GPUS}" in result.stdout
    assert max_diff(load_weights(tmp_path / mode), load_weights(one)) < 5e-2


@pytest.mark.e2e
def test_activation_checkpointing_on_gpu_matches(bf16_reference, train_env, tmp_path):
    args = cuda_args(
        train_env, tmp_path, "--dtype", "bf16", "--activation-checkpointing", "--no-compile"
    )
    assert run_train(train_env, args).returncode == 0
    # Recomputation repeats the same kernels; only CUDA's non-deterministic reductions (flash
    # attention's backward) can tell the runs apart, as they can two plain runs.
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2


def test_task_scores_on_a_gpu_equal_the_cpus():
    """The evaluator's CUDA path (the same code as the CPU's): fp32 log-likelihoods equal the
    CPU's, bf16 autocast stays close to them."""
    import random

    from llama_ddp.eval.scoring import loglikelihoods
    from llama_ddp.model.llama import LlamaForPretraining

    rng = random.Random(0)
    requests = [
        ([0, *(rng.randrange(3, 300) for _ in range(rng.randint(0, 40)))], [5, 6, 7])
        for _ in range(20)
    ]
    torch.manual_seed(0)
    model = LlamaForPretraining(preset("tiny", vocab_size=300)).eval()
    expected = loglikelihoods(model, requests)
    model.cuda()
    cuda = torch.device("cuda")
    assert loglikelihoods(model, requests, batch_tokens=64) == pytest.approx(expected, abs=1e-3)
    bf16 = loglikelihoods(model, requests, precision=Precision(torch.bfloat16, cuda))
    assert bf16 == pytest.approx(expected, rel=0.02)


def test_prefetched_batches_are_the_loaders_on_the_gpu(train_env, tmp_path):
    """The prefetching thread copies each step's micro-batches to the GPU on its side stream:
    the loop gets them in the loader's order, on the device (the flash varlen plan), equal to
    the host's."""
    from llama_ddp.data.batch import Prefetcher
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    argv = cuda_args(
        train_env, tmp_path, "--dtype", "bf16", "--no-compile", "--micro-batch-size", "4"
    )
    cfg = parse_train_args([*argv, "--cache-dir", str(train_env["root"] / "cache")])
    trainer = build_trainer(cfg, D.setup("single", "cuda"))
    host = trainer.data.batches(0)
    expected = [next(host) for _ in range(4)]
    prefetched = Prefetcher(trainer.data.batches(0), torch.device("cuda"))
    try:
        for want in expected:
            got = next(prefetched)
            assert len(got) == len(want) == 2
            for g, w in zip(got, want):
                assert g.x.is_cuda and g.plan.cu_seqlens.is_cuda and g.plan.kernel == "varlen"
                assert torch.equal(g.x.cpu(), w.x) and torch.equal(g.labels.cpu(), w.labels)
                assert torch.equal(g.plan.cu_seqlens.cpu(), w.plan.cu_seqlens)
    finally:
        prefetched.close()


def test_the_chunked_loss_on_the_gpu_equals_the_whole_logits_in_bf16_with_less_memory():
    """Under bf16 autocast on CUDA, the chunked lm_head and loss (model/loss.py) give the whole
    logits' loss to the order of fp32 sums of bf16 logits, their gradients within a bf16 step
    (2^-7) of the largest, and a peak under half the whole's (fp32 logits alone: 512 MiB);
    compiled (as where the run compiles: each chunk's softmax, loss and gradient fused), the
    same within the same bounds and a peak no higher than eager chunks'."""
    import torch.nn.functional as F

    from llama_ddp.model.loss import IGNORE_INDEX, linear_token_loss_sum, token_loss_sum

    torch.manual_seed(0)
    dev = torch.device("cuda")
    hidden = torch.randn(16384, 768, device=dev, requires_grad=True)
    weight = (0.02 * torch.randn(8192, 768, device=dev)).requires_grad_()
    labels = torch.randint(0, 8192, (16384,), device=dev)
    labels[::9] = IGNORE_INDEX
    results = {}
    with torch.autocast("cuda", dtype=torch.bfloat16):  # compiled before it is measured
        linear_token_loss_sum(hidden, weight, labels, backend="inductor").backward()
    hidden.grad = weight.grad = None
    for name in ("whole", "chunked", "compiled"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if name == "whole":
                loss = token_loss_sum(F.linear(hidden, weight), labels)
            else:
                backend = "inductor" if name == "compiled" else None
                loss = linear_token_loss_sum(hidden, weight, labels, backend=backend)
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        results[name] = (loss.item(), hidden.grad.clone(), weight.grad.clone(), peak)
        hidden.grad = weight.grad = None
    (whole, *whole_grads, whole_peak) = results.pop("whole")
    for chunked, *chunked_grads, chunked_peak in results.values():
        assert chunked == pytest.approx(whole, rel=1e-3)
        for a, b in zip(whole_grads, chunked_grads):
            assert (a - b).abs().max().item() <= 2**-7 * a.abs().max().item()
        assert whole_peak > 512 * 2**20 and chunked_peak < whole_peak / 2, chunked_peak
    assert results["compiled"][-1] <= results["chunked"][-1]


def test_compiled_newton_schulz_on_the_gpu_is_the_eager_update_in_bf16():
    """Muon with Newton-Schulz through torch.compile (train.py's on CUDA) moves the weights as
    the eager one does, within a sixteenth of the distance they moved: bf16's rounding (2^-8)
    amplified by the iterations about tenfold; a wrong update would differ by all of it."""
    from llama_ddp.train.muon import Muon

    torch.manual_seed(0)
    shapes = [(768, 768), (768, 768), (3072, 768), (768, 3072), (192, 768)]
    eager = [torch.randn(s, device="cuda", requires_grad=True) for s in shapes]
    compiled = [p.detach().clone().requires_grad_() for p in eager]
    start = [p.detach().clone() for p in eager]
    settings = dict(lr=1e-2, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    optimizers = [
        Muon(eager, ns_dtype=torch.bfloat16, **settings),
        Muon(compiled, ns_dtype=torch.bfloat16, compiled=True, **settings),
    ]
    for _ in range(3):
        grads = [torch.randn_like(p) for p in eager]
        for params, opt in zip((eager, compiled), optimizers):
            for p, g in zip(params, grads):
                p.grad = g.clone()
            opt.step()
    moved = max((a - p0).abs().max().item() for a, p0 in zip(eager, start))
    assert max((a - b).abs().max().item() for a, b in zip(eager, compiled)) < moved / 16


def test_auto_micro_batch_measures_a_step_and_accumulates_within_a_budget(
    train_env, tmp_path, monkeypatch
):
    """--micro-batch-size auto, CUDA's default: probe steps measured on the GPU (a peak that
    grows with the micro-batch), leaving the weights as they were and no gradient; a budget
    between the measured step at 2 and at 4 gives 2 x 1 x 4 accumulation."""
    import gc

    from llama_ddp.distributed import memory
    from llama_ddp.train.cli import parse_train_args
    from llama_ddp.train.run import build_trainer

    argv = cuda_args(train_env, tmp_path, "--dtype", "bf16", "--seq-length", "256")
    cfg = parse_train_args([*argv, "--cache-dir", str(train_env["root"] / "cache")])
    trainer = build_trainer(cfg, D.setup("single", "cuda"))
    assert trainer.micro_batch_note.startswith("micro-batch 8 (auto: a step at 2 peaked at ")
    assert trainer.data.sampler.accum_steps == 1
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    probe = memory.measure(
        trainer.train_model, trainer.model, trainer.precision, torch.device("cuda"),
        lambda m: memory.probe_batch(m, 256, "pack", True),
    )  # fmt: skip
    assert probe.out_of_memory is None and len(probe.peaks) == 2
    line = probe.model(memory.local_parameters(trainer.model))
    weights = sum(p.numel() * 4 for p in trainer.model.parameters())
    assert line.per_sample > 0 and line.fixed > weights
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in trainer.model.state_dict().items())
    trainer.data.close()
    del trainer, before
    gc.collect()
    # Half a sequence's activations of slack either side: the second build measures again.
    budget = (line.peak(2) + line.peak(4)) / 2 / (1 - memory.MARGIN)
    monkeypatch.setenv(memory.BUDGET_ENV, str(int(budget)))
    trainer = build_trainer(cfg, D.setup("single", "cuda"))
    sampler = trainer.data.sampler
    assert (sampler.micro_batch, sampler.accum_steps) == (2, 4), trainer.micro_batch_note
    trainer.data.close()


def test_the_weight_gradient_is_summed_in_fp32_on_the_gpu():
    """The chunked loss's weight gradient (model/loss.py, `add_product`): bf16 products summed
    into fp32, in the matmul itself where CUDA's out_dtype does it, within a bf16 product's error
    of the fp32 sum; which path ran is printed."""
    from llama_ddp.model import loss

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    chunks = [
        [torch.randn(4096, n, device=device, generator=g).bfloat16() for n in (8192, 768)]
        for _ in range(3)
    ]
    total = torch.zeros(8192, 768, device=device)
    for a, b in chunks:
        loss.add_product(total, a.T, b)
    exact = sum(a.double().T @ b.double() for a, b in chunks)
    print("fp32 accumulation in the matmul:", loss._accumulates_in_fp32(device, torch.bfloat16))
    assert (total.double() - exact).abs().max() <= 1e-2 * exact.abs().max()
