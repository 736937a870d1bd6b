#!/usr/bin/env bash
# Issue 7's GPU benchmark: the article's base model, seq 512, on one CUDA GPU.
#
#   bench/bench_gpu.sh                    # writes bench/results/train-cuda-<date>.json
#   bench/bench_gpu.sh --batch-size 64    # extra flags go to bench_train.py
#
# ours+flash is llama_ddp with bf16 autocast, torch.compile, fused AdamW (its CUDA default) and
# SDPA restricted to the flash kernel (is_causal + enable_gqa; an error if flash cannot run);
# ours is the same with PyTorch's own SDPA choice (recent cuDNN on sm90 may pick cuDNN attention);
# transformers runs with bf16 autocast, its sdpa attention and torch's default AdamW; the article's
# model in fp32 with its explicit (B, 1, T, T) mask. The table reports tokens/s, MFU against the
# GPU's bf16 peak (llama_ddp.metrics table; --peak-tflops for a GPU it lacks),
# torch.cuda.max_memory_allocated per contender, and the attention kernels each one ran.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p bench/results
"$PY" bench/bench_train.py --device cuda --preset base --seq-length 512 --dtype bf16 --compile \
    --contenders ours+flash,ours,transformers,article \
    --steps 20 --rounds 3 --warmup 3 --json "bench/results/train-cuda-$(date +%Y%m%d).json" "$@"
