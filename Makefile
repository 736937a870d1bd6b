# llama_ddp: `make pretrain-small` and `make test` work on a fresh machine.
# torch is installed first, pinned, so a CPU-only machine never downloads CUDA packages.
# Change the pin (or add an index) on the command line:
#   make install TORCH_VERSION=2.13.0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
TORCH_INDEX_URL ?=
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed-$(TORCH_VERSION)
# A machine with torch already installed and no internet (a GPU box): skip the install and run with
# its python, e.g. `make test-gpu bench-gpu PY=python3 NO_INSTALL=1` (the tokenizer is in the repo;
# the machine needs this package's dependencies, datasets included, installed or on PYTHONPATH).
NO_INSTALL ?=
INSTALL := $(if $(NO_INSTALL),,install)
# Everything here runs offline unless the user asks for a hub dataset.
OFFLINE := HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
TOKENIZER := tokenizer/tokenizer.json
SMALL_OUT ?= out/small
SMALL_SIZE ?= 1
SMALL_STEPS ?= 600
SMALL_EVERY ?= 300
SMALL_VOCAB ?= 4096
SMALL_TOKENIZER := tokenizer/tokenizer-$(SMALL_VOCAB).json
BUDGET ?= 10m
BUDGET_OUT ?= out/budget
PROMPT ?= def
SAMPLE_TOKENS ?= 120

OLDEST_TORCH ?= 2.9.0

.PHONY: install test test-oldest-torch test-gpu lint format tokenizer pretrain-small pretrain generate plot bench \
	bench-gpu bench-parallel clean gpu-wheels gpu-check

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet "torch==$(TORCH_VERSION)" $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(PIP) install --quiet -e ".[dev]"
	touch $@

# One pytest-xdist worker per core (TEST_WORKERS=0: none), whole files to a worker so that a
# file's module fixtures are built once, the longest files first (tests/conftest.py); the time of
# the tests is pytest's closing line, the time with the install the line after it.
TEST_WORKERS ?= auto
TEST_XDIST = $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test:
	@start=$$(date +%s); $(MAKE) --no-print-directory install && \
	$(OFFLINE) $(PY) -m pytest -q $(TEST_XDIST); status=$$?; \
	echo "make test: $$(( $$(date +%s) - start )) s with its install"; exit $$status

# The oldest torch pyproject.toml accepts, in a virtual environment of its own, the whole suite on
# the CPU (not part of `make test`: the registry's x86_64 torch 2.9 is a CUDA build, ~7.8 GB
# installed with its nvidia packages, minutes to download).
test-oldest-torch:
	$(MAKE) test VENV=.venv-torch$(OLDEST_TORCH) TORCH_VERSION=$(OLDEST_TORCH)

# The CUDA tests (skipped by `make test` on a machine without a GPU).
test-gpu: $(INSTALL)
	$(OFFLINE) $(PY) -m pytest -q -m gpu

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: install
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# The sample tokenizer: byte-level BPE, 8192 tokens, trained on the embedded corpus.
tokenizer: $(TOKENIZER)

$(TOKENIZER): | $(INSTALL)
	$(OFFLINE) $(PY) tokenizer/train_tokenizer.py --dataset sample --vocab-size 8192 --out $@

# make pretrain-small's: the same corpus, $(SMALL_VOCAB) tokens.
$(SMALL_TOKENIZER): | $(INSTALL)
	$(OFFLINE) $(PY) tokenizer/train_tokenizer.py --dataset sample --vocab-size $(SMALL_VOCAB) --out $@

# About 3 minutes on 2 CPU cores (BENCHMARKS.md, bench/bench_small.py): the model family's
# depth-1 member (0.6M parameters) on a tokenizer of 4096 tokens of its own (bits per byte do not
# depend on the tokenizer: half the lm_head's work a step, 9% more tokens a byte), 600 steps of
# Muon at batch 16, WSD with a long decay (the last 60% of the steps, a warmup of 20), evaluated
# at the end only: of the recipes measured side by side, the one at today's bpb (1.230) in the
# least time. Interrupted or run again, it resumes from its last checkpoint (delete
# $(SMALL_OUT) to start over).
pretrain-small: install $(SMALL_TOKENIZER)
	$(OFFLINE) $(PY) train.py --model-size $(SMALL_SIZE) --dataset sample \
		--tokenizer $(SMALL_TOKENIZER) --seq-length 256 --batch-size 16 --max-steps $(SMALL_STEPS) \
		--lr-schedule wsd --decay-fraction 0.6 --warmup-steps 20 --eval-every 0 \
		--save-every $(SMALL_EVERY) --eval-tasks stdlib-mc --eval-limit 100 --out-dir $(SMALL_OUT)
	@echo "--- a sample from $(SMALL_OUT)/llama_model.pth:"
	$(OFFLINE) $(PY) -m llama_ddp.generate --model $(SMALL_OUT)/llama_model.pth \
		--prompt "$(PROMPT)" --max-new-tokens $(SAMPLE_TOKENS) --temperature 0.8 --top-k 50 --seed 0

# The embedded corpus at batch 16 x 256 for the time given (`make pretrain BUDGET=10m`), on the
# repo's tokenizer (the one the size rule's runs used): the model's size is
# chosen for that time from a few steps of candidates timed here (--model-size auto), the steps
# are planned from measured step times and the run ends by then, decayed, evaluated, saved and
# exported.
pretrain: install $(TOKENIZER)
	$(OFFLINE) $(PY) train.py --model-size auto --dataset sample --tokenizer $(TOKENIZER) \
		--seq-length 256 --batch-size 16 --time-budget $(BUDGET) --lr-schedule wsd \
		--eval-every 70 --save-every 70 --eval-tasks stdlib-mc --eval-limit 100 \
		--out-dir $(BUDGET_OUT)

generate: install
	$(OFFLINE) $(PY) -m llama_ddp.generate --model $(SMALL_OUT)/llama_model.pth \
		--prompt "$(PROMPT)" --max-new-tokens $(SAMPLE_TOKENS) --temperature 0.8 --top-k 50

plot: install
	$(PY) -m llama_ddp.plot $(SMALL_OUT)/metrics.jsonl

bench: install $(TOKENIZER)
	$(OFFLINE) $(PY) bench/bench_data.py
	$(OFFLINE) $(PY) bench/bench_generate.py
	$(OFFLINE) $(PY) bench/bench_train.py --json bench/results/train-cpu.json
	$(OFFLINE) $(PY) bench/bench_train.py --seq-length 1024 --max-position-embeddings 1024 \
		--batch-size 8 --no-train-py --json bench/results/train-cpu-1024.json
	$(OFFLINE) $(PY) bench/bench_train.py --seq-length 1024 --max-position-embeddings 1024 \
		--batch-size 8 --dataset sample-paragraphs --contenders ours,ours+causal --no-train-py \
		--json bench/results/train-cpu-1024-short.json
	$(OFFLINE) $(PY) bench/bench_train.py --packing pad --dataset sample-paragraphs \
		--no-train-py --json bench/results/train-cpu-pad.json
	$(OFFLINE) $(PY) bench/bench_attention.py --seq-length 1024 --batch-size 8 \
		--dataset sample-paragraphs --json bench/results/attention-cpu.json
	$(OFFLINE) $(PY) bench/bench_ops.py --json bench/results/ops-cpu.json
	$(OFFLINE) $(PY) bench/bench_optim.py --device cpu --rounds 3 --json bench/results/optim-cpu.json

# On one GPU, under 8 minutes: train.py itself at base 1024 x 64, at its defaults and with
# --optimizer adamw (tokens/s, MFU, time to the first step, compiling, data wait, checkpoint time,
# peak memory), then the contenders (ours against transformers) at the same shapes.
bench-gpu: $(INSTALL) $(TOKENIZER)
	PY=$(PY) bench/bench_gpu.sh

# The wheels the GPU machine lacks (datasets and what it needs beyond torch and transformers), for
# cp312 manylinux x86_64, into wheels/ (git-ignored); `make gpu-check` there installs them offline.
GPU_WHEELS ?= datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0
gpu-wheels:
	$(PY) -m pip download --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --no-deps -d wheels $(GPU_WHEELS)

# On a GPU machine with no internet: install wheels/, then test-gpu and bench-gpu, logs in $$OUT.
gpu-check:
	scripts/gpu_check.sh

# DDP x2 against FSDP x2 under torchrun, the cost of activation checkpointing, and memory per
# rank (measured and computed); a few minutes on 2 CPU cores.
bench-parallel: install $(TOKENIZER)
	$(OFFLINE) $(PY) bench/bench_modes.py --json bench/results/modes-cpu.json
	$(OFFLINE) $(PY) bench/bench_memory.py --json bench/results/memory-cpu.json

clean:
	rm -rf $(VENV) out .pytest_cache .ruff_cache *.egg-info
