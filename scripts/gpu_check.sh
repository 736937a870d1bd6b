#!/usr/bin/env bash
# The prepared GPU check (issue 53): every figure this project owes from a GPU, most important
# first, each part under its own timeout and all of them within CHECK_LIMIT seconds (default 540:
# 9 minutes on one H100 or H200). On a machine with no internet: the wheels brought beside the
# project (`make gpu-wheels`, folder wheels/) are installed into the machine's own python first.
#
#   scripts/gpu_check.sh                     # every part, in this order
#   scripts/gpu_check.sh env mfu kernels     # only these parts (install always runs first)
#   CHECK_LIMIT=300 scripts/gpu_check.sh     # a shorter window: parts that no longer fit are skipped
#
# Parts: env (torch, GPU, cuDNN, flash packages), mfu (train.py at its defaults, base 1024 x 64:
# tokens/s, MFU, compile time, peak memory), tests (every `-m gpu` test, 8 at a time), kernels
# (each attention backend timed and checked, what --attention auto takes), contenders (ours
# against transformers at the same shape, and the 40 costliest kernels of each one's step),
# optim (the optimizer step alone: Muon's share of a step), loss (whole logits against chunks at
# vocab 8192 and 131072), and when named, adamw (train.py with --optimizer adamw). The folder $CHECK_OUT (default $OUT, else out/gpu-check) gets
# summary.txt (a line per part: its exit code, seconds, and its figures) and logs.tar.gz (every
# part's log and JSON): two files, as a device that returns few files wants.
set -u
cd "$(dirname "$0")/.."
DEST="${CHECK_OUT:-${OUT:-out/gpu-check}}"
PY="${PY:-python3}"
WHEELS="${WHEELS:-wheels}"
LIMIT="${CHECK_LIMIT:-540}"
ALL="env mfu tests kernels contenders optim loss"
PARTS="${*:-$ALL}"
LOGS="$(mktemp -d)"
RESULTS="$LOGS/results"
mkdir -p "$DEST" "$RESULTS"
: >"$DEST/summary.txt"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the package, not installed there (NO_INSTALL)
start_all=$SECONDS
status=0

step() {  # step NAME SECONDS COMMAND...: under a timeout (cut to the time left), logged
  local name="$1" limit="$2"; shift 2
  local left=$((LIMIT - (SECONDS - start_all) - 5))
  if [ "$left" -lt 20 ]; then
    echo "$name: skipped (${left} s left of the check's ${LIMIT} s)" | tee -a "$DEST/summary.txt"
    status=1
    return
  fi
  [ "$limit" -le "$left" ] || limit=$left
  local t0=$SECONDS
  timeout --kill-after=5 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  local note=""
  [ "$rc" -eq 124 ] && note=" (timed out at ${limit} s)"
  echo "$name: rc $rc in $((SECONDS - t0)) s$note" | tee -a "$DEST/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}

has() { case " $PARTS " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

if [ -d "$WHEELS" ]; then
  # --no-deps: the rest of what datasets needs (pyarrow, pandas, fsspec, huggingface-hub) is there
  step install 60 "$PY" -m pip install -q --no-index --no-deps "$WHEELS"/*.whl
fi
day=$(date +%Y%m%d)
has env && step env 30 bash -c "nvidia-smi; $PY -c '
import importlib.util as u, torch, datasets, transformers
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"cudnn\", torch.backends.cudnn.version())
print(\"gpu\", torch.cuda.get_device_name(), torch.cuda.get_device_capability())
print(\"datasets\", datasets.__version__, \"transformers\", transformers.__version__)
for m in (\"flash_attn\", \"flash_attn_interface\", \"flash_attn.cute\"):
    try: print(m, u.find_spec(m) is not None)
    except Exception as e: print(m, \"broken:\", e)
from llama_ddp.model import loss
print(\"weight gradient summed in fp32 in the matmul:\", loss._accumulates_in_fp32(torch.device(\"cuda\"), torch.bfloat16))
'"
[ -f "$LOGS/env.log" ] && grep -E "^(torch|gpu|datasets|flash|weight) " "$LOGS/env.log" | sed 's/^/  /' >>"$DEST/summary.txt"
# train.py at its defaults (compile, Muon, --attention auto, --micro-batch-size auto): MFU.
has mfu && step mfu 170 "$PY" bench/bench_run.py --device cuda --preset base --seq-length 1024 \
  --batch-size 64 --steps 30 --runs defaults --timeout 160 --json "$RESULTS/run-defaults.json"
# Every GPU test, 8 at a time (pytest-xdist where installed).
if has tests; then
  xdist=$("$PY" -c "import xdist" 2>/dev/null && echo "-n 8")
  step tests 240 "$PY" -m pytest -q -m gpu $xdist -p no:cacheprovider \
    --junitxml="$RESULTS/tests.xml" tests
fi
has kernels && step kernels 90 "$PY" bench/bench_kernels.py --rounds 2 \
  --json "$RESULTS/kernels.json"
has contenders && step contenders 180 "$PY" bench/bench_train.py --device cuda --preset base \
  --seq-length 1024 --batch-size 64 --contenders ours,transformers --steps 3 --rounds 2 \
  --warmup 2 --no-train-py --profile 40 --json "$RESULTS/contenders.json"
has optim && step optim 90 "$PY" bench/bench_optim.py --device cuda --rounds 10 \
  --json "$RESULTS/optim.json"
has loss && step loss 60 "$PY" bench/bench_loss.py --device cuda --tokens 65536 --rounds 5 \
  --json "$RESULTS/loss.json"
# A Llama-3-sized vocabulary: the weight gradient's traffic of Liger's chunks (issue 53, item 4).
has loss && step loss-128k 60 "$PY" bench/bench_loss.py --device cuda --tokens 32768 \
  --vocab 131072 --dtypes bf16 --contenders whole,chunked,liger --rounds 5 \
  --json "$RESULTS/loss-128k.json"
has adamw && step adamw 150 "$PY" bench/bench_run.py --device cuda --preset base \
  --seq-length 1024 --batch-size 64 --steps 30 --runs "--optimizer adamw" --timeout 140 \
  --json "$RESULTS/run-adamw.json"
"$PY" scripts/gpu_figures.py "$RESULTS" "$LOGS" >>"$DEST/summary.txt" 2>&1
echo "check: $((SECONDS - start_all)) s of ${LIMIT} s" >>"$DEST/summary.txt"
tar -czf "$DEST/logs.tar.gz" -C "$LOGS" . 2>/dev/null
exit "$status"
