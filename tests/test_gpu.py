"""CUDA paths the CPU suite cannot run: skipped on a machine without a GPU (make test-gpu)."""

import pytest
import torch
from conftest import load_weights, max_diff, run_train, tiny_args

from llama_ddp import distributed as D
from llama_ddp.cli import parse_train_args
from llama_ddp.config import TrainConfig
from llama_ddp.model_config import preset
from llama_ddp.parallelize import build_model, parallelize
from llama_ddp.precision import Precision
from llama_ddp.run import build_trainer

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
two_gpus = pytest.mark.skipif(GPUS < 2, reason="needs 2 or more GPUs")


def cuda_args(train_env, out, *extra):
    return [*tiny_args(train_env, out, *extra), "--device", "cuda"]


@pytest.fixture(scope="module")
def bf16_reference(train_env, tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-bf16")
    result = run_train(train_env, cuda_args(train_env, out, "--dtype", "bf16"))
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_single_gpu_bf16_training_learns(bf16_reference):
    import json

    records = [json.loads(line) for line in (bf16_reference / "metrics.jsonl").open()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0] - 0.3 and all(loss == loss for loss in losses)


def test_compile_on_gpu_matches_eager(bf16_reference, train_env, tmp_path):
    args = cuda_args(train_env, tmp_path, "--dtype", "bf16", "--compile")
    assert run_train(train_env, args).returncode == 0
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2  # bf16 kernels


@two_gpus
def test_data_parallel_replicas_compute_in_bf16():
    model = build_model(preset("tiny", vocab_size=64), 0, torch.device("cuda", 0))
    precision = Precision(torch.bfloat16, torch.device("cuda", 0))
    rt = D.Runtime("dp", torch.device("cuda", 0), replicas=GPUS)
    wrapped = parallelize(model, rt, TrainConfig(), precision)
    seen = []
    model.lm_head.register_forward_hook(lambda m, args, out: seen.append(out.dtype))
    with precision.autocast():
        wrapped(torch.randint(0, 64, (2 * GPUS, 16), device="cuda"))
    assert len(seen) == GPUS and set(seen) == {torch.bfloat16}


@two_gpus
def test_data_parallel_training_matches_one_gpu(bf16_reference, train_env, tmp_path):
    result = run_train(train_env, cuda_args(train_env, tmp_path, "--dtype", "bf16", "--mode", "dp"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2


def test_a_training_step_does_not_synchronize(train_env, tmp_path):
    cfg = parse_train_args(
        [*cuda_args(train_env, tmp_path), "--cache-dir", str(train_env["root"] / "cache")]
    )
    trainer = build_trainer(cfg, D.setup("single", "cuda"))
    batches = trainer.data.batches(0)
    for _ in range(2):  # optimizer state, kernels and caches warmed up
        trainer.train_step(next(batches), False)
    steps = [next(batches) for _ in range(3)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for micro_batches in steps:
            trainer.train_step(micro_batches, False)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_all_gpus_under_torchrun_match_one_gpu(mode, bf16_reference, train_env, tmp_path):
    """DDP and FSDP2 over every visible GPU (NCCL), bf16 autocast (FSDP: bf16 compute, fp32
    master weights and reduction): the weights of one GPU to bf16 tolerance (5e-2 after 8 steps:
    bf16 matmuls round differently with other batch splits)."""
    args = cuda_args(train_env, tmp_path, "--dtype", "bf16", "--mode", mode)
    result = run_train(train_env, args, ["--standalone", f"--nproc_per_node={GPUS}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"mode {mode} x{GPUS}" in result.stdout
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2


def test_activation_checkpointing_on_gpu_matches(bf16_reference, train_env, tmp_path):
    args = cuda_args(train_env, tmp_path, "--dtype", "bf16", "--activation-checkpointing")
    assert run_train(train_env, args).returncode == 0
    # Recomputation repeats the same kernels; only CUDA's non-deterministic reductions (flash
    # attention's backward) can tell the runs apart, as they can two plain runs.
    assert max_diff(load_weights(tmp_path), load_weights(bf16_reference)) < 5e-2


def test_task_scores_on_a_gpu_equal_the_cpus():
    """The evaluator's CUDA path (the same code as the CPU's): fp32 log-likelihoods equal the
    CPU's, bf16 autocast stays close to them."""
    import random

    from llama_ddp.evaluate import loglikelihoods
    from llama_ddp.model import LlamaForPretraining

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
