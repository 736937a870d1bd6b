#!/usr/bin/env bash
# The GPU benchmark (make bench-gpu): what a user runs, on one CUDA GPU, in under 8 minutes.
#
#   bench/bench_gpu.sh                 # writes bench/results/{run,train}-cuda-<date>.json
#   PY=python3 bench/bench_gpu.sh      # with the machine's python (make bench-gpu PY=... NO_INSTALL=1)
#   ALL=1 bench/bench_gpu.sh           # also DDP/FSDP over every GPU and the kernels per step
#
# 1. bench_run.py: `python train.py --preset base --seq-length 1024 --batch-size 64` for 40 steps
#    (a checkpoint at step 20), at its defaults (compile auto: on; Muon) and with --optimizer
#    adamw: tokens/s and MFU at steady state, the second log window against it, the time to the
#    first step and the first step's excess (compiling), waiting for data, the mid-run
#    checkpoint's blocking and total seconds, peak memory.
# 2. bench_train.py: ours (train.py's defaults: compiled, flash varlen on documents, bf16,
#    AdamW) against transformers' LlamaForCausalLM (bf16 autocast, its sdpa attention on plain
#    causal windows) at the same shapes, and the 40 kernels of each one's step that take the most
#    GPU time (where the step's time goes: issue 45's elementwise passes). The article's model is
#    left out: its fp32 (B, 1, T, T) masks and probabilities at 64 x 1024 need more memory than a
#    GPU has.
# 3. bench_optim.py: the optimizer step alone (Muon batched, compiled, per matrix; AdamW).
# 4. bench_loss.py: the lm_head and loss, whole logits against chunks, eager and compiled: peak
#    memory and time.
# 5. bench_kernels.py (run second): each attention backend for packed documents (flash-varlen, cudnn, fa3/fa4
#    where installed) at the base and a 1B shape, timed and checked exact; what --attention auto
#    takes.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p bench/results
day=$(date +%Y%m%d)
"$PY" bench/bench_run.py --device cuda --preset base --seq-length 1024 --batch-size 64 \
    --steps 40 --runs "defaults;--optimizer adamw" --json "bench/results/run-cuda-$day.json"
# Each attention backend this GPU runs, at the base and a 1B shape: forward + backward, exactness.
"$PY" bench/bench_kernels.py --json "bench/results/kernels-cuda-$day.json"
"$PY" bench/bench_train.py --device cuda --preset base --seq-length 1024 --batch-size 64 \
    --contenders ours,transformers --steps 5 --rounds 3 --warmup 3 --no-train-py --profile 40 \
    --json "bench/results/train-cuda-$day.json"
# The optimizer step alone on the base preset: Muon batched, compiled, per matrix; AdamW (bf16 run).
"$PY" bench/bench_optim.py --device cuda --rounds 10 --json "bench/results/optim-cuda-$day.json"
# The lm_head and loss at base width, vocab 8192, 64 x 1024 tokens: whole logits against chunks, eager and compiled.
"$PY" bench/bench_loss.py --device cuda --tokens 65536 --rounds 10 --json "bench/results/loss-cuda-$day.json"
if [ "${ALL:-0}" = 1 ]; then
    # DDP and FSDP over every visible GPU, and the cost of activation checkpointing.
    gpus=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    "$PY" bench/bench_modes.py --device cuda --dtype bf16 --preset base --seq-length 512 \
        --batch-size 32 --nproc "$gpus" --steps 20 --rounds 2 --json "bench/results/modes-cuda-$day.json"
    # Kernels per training step: one flash varlen call per layer forward with documents apart.
    "$PY" bench/bench_ops.py --device cuda --json "bench/results/ops-cuda-$day.json"
fi
