#!/usr/bin/env bash
# The GPU benchmark: the article's base model, seq 512, on one CUDA GPU.
#
#   bench/bench_gpu.sh                    # writes bench/results/train-cuda-*-<date>.json
#   bench/bench_gpu.sh --batch-size 64    # extra flags go to bench_train.py
#
# Two invocations, because torch.compile keeps one graph per code object: two compiled variants
# of our model in one process would share it (and its attention kernel). The first compares ours
# (bf16 autocast, torch.compile, fused AdamW, PyTorch's own SDPA kernel choice) with transformers
# (bf16 autocast, its sdpa attention, torch's default AdamW) and the article's fp32 model with its
# explicit (B, 1, T, T) mask; the second runs ours with SDPA restricted to the flash kernel
# against the same baselines. Each table reports tokens/s, MFU against the GPU's bf16 peak
# (llama_ddp.train.metrics table; --peak-tflops for a GPU it lacks), torch.cuda.max_memory_allocated per
# contender, and the attention kernels each one ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p bench/results
day=$(date +%Y%m%d)
for ours in ours ours+flash; do
    "$PY" bench/bench_train.py --device cuda --preset base --seq-length 512 --dtype bf16 --compile \
        --contenders "$ours,transformers,article" --steps 20 --rounds 3 --warmup 3 \
        --json "bench/results/train-cuda-$ours-$day.json" "$@"
done
# DDP and FSDP over every visible GPU, and the cost of activation checkpointing, with each run's
# torch.cuda.max_memory_allocated (train.py logs it in metrics.jsonl on CUDA).
gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
"$PY" bench/bench_modes.py --device cuda --dtype bf16 --preset base --seq-length 512 \
    --batch-size 32 --nproc "$gpus" --steps 20 --rounds 2 --json "bench/results/modes-cuda-$day.json"
# Kernels per training step (base's depth and heads, micro-batch 8 x 2048, bf16): every kernel,
# and the attention ones (one flash varlen call per layer forward with documents kept apart).
"$PY" bench/bench_ops.py --device cuda --json "bench/results/ops-cuda-$day.json"
# The optimizer step alone on the base preset: Muon batched, Muon per matrix, AdamW (bf16 run).
"$PY" bench/bench_optim.py --device cuda --rounds 10 --json "bench/results/optim-cuda-$day.json"
