#!/usr/bin/env bash
# One prepared GPU check (issue 45, item 6): on a GPU machine with no internet, install the wheels
# brought beside the project (`make gpu-wheels`, folder wheels/) into the machine's own python,
# then run `make test-gpu` and `make bench-gpu` with NO_INSTALL=1 PY=python3, each step under its
# own timeout, all under 9 minutes. Logs go to the folder given as $1 (default $OUT, else out/gpu-check).
set -u
DEST="${1:-${OUT:-out/gpu-check}}"
PY="${PY:-python3}"
WHEELS="${WHEELS:-wheels}"
mkdir -p "$DEST"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
status=0
step() {  # step NAME SECONDS COMMAND...: run it under a timeout, log to $DEST/NAME.log
  local name="$1" limit="$2"; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$DEST/$name.log" 2>&1
  local rc=$?
  echo "$name: rc $rc in $((SECONDS - start)) s (log $DEST/$name.log)" | tee -a "$DEST/summary.txt"
  [ "$rc" -eq 0 ] || status=1
}
if [ -d "$WHEELS" ]; then
  # --no-deps: the rest of what datasets needs (pyarrow, pandas, fsspec, huggingface-hub) is there
  step install 40 "$PY" -m pip install --no-index --no-deps "$WHEELS"/*.whl
fi
step env 15 "$PY" -c "import torch, datasets; print(torch.__version__, torch.cuda.get_device_name(), datasets.__version__)"
step test-gpu 170 make test-gpu NO_INSTALL=1 PY="$PY"
step bench-gpu 290 make bench-gpu NO_INSTALL=1 PY="$PY"
cp -r bench/results "$DEST/" 2>/dev/null || true
exit "$status"
