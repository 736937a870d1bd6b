"""train/sizing/auto.py's sizes (a tied run's embedding counted once) and its banner
(`describe`) for choices made at a GPU node's and this CPU's step times: where the prediction
comes from, no bpb it cannot stand behind, a corpus far smaller than the tokens planned, and a
budget in which no step fits."""

import re

from llama_ddp.train.cli import parse_train_args
from llama_ddp.train.sizing.auto import describe, family_sizes
from tests.train.sizing.test_scale import (
    CORPUS,
    CPU_SIZES,
    CPU_STEP_TOKENS,
    GPU_SIZES,
    GPU_STEP_TOKENS,
    Node,
    cpu,
    gpu_choice,
)


def test_on_a_gpu_node_the_banner_names_the_published_law_and_prints_no_bpb():
    lines = describe(gpu_choice(8 * 3600), None)
    assert lines[0].startswith("model size: auto chose depth 17 (223.84M parameters")
    assert re.search(r"19\.\d{2} tokens per parameter, [^;]*; ranked by Besiroglu et al\. "
                     r"2024's re-fit of Chinchilla's law at 37\.2x the largest N measured, 1,80\dx "
                     r"the most tokens measured, no bpb predicted\); runner-up: depth",
                     lines[0])  # fmt: skip
    assert "bpb 0." not in " ".join(lines) and "predicted val bpb" not in " ".join(lines)
    assert "the prediction is Besiroglu et al. 2024's re-fit of Chinchilla's law" in lines[1]
    assert lines[2].startswith("note: the corpus's size is not known yet")


def test_on_the_cpu_inside_the_runs_a_bpb_and_beyond_them_one_labelled_extrapolated():
    three = Node(cpu(180), 180, 6.0).choose(CPU_SIZES, CPU_STEP_TOKENS, CORPUS)
    lines = describe(three, CORPUS)
    assert re.search(r"auto chose depth 1 \(1\.10M parameters, .*; predicted val bpb 1\.\d{3}\); "
                     r"runner-up: depth 2", lines[0])  # fmt: skip
    assert "the prediction is train/sizing/law.py's fit of this project's runs" in lines[1]
    assert len(lines) == 2  # 0.9M tokens of a 2.69M corpus: no repetition
    ten = describe(Node(cpu(600), 600, 6.0).choose(CPU_SIZES, CPU_STEP_TOKENS, CORPUS), CORPUS)
    assert re.search(r"predicted val bpb 1\.\d{3}, extrapolated to 1\.\d+x the most tokens "
                     r"measured\)", ten[0])  # fmt: skip
    assert re.fullmatch(r"note: the corpus holds 2\.69M tokens a pass, fewer than the 3\.\d\dM "
                        r"planned: they repeat 1\.\d times, worth 1\.\d passes of new tokens .*",
                        ten[2])  # fmt: skip


def test_a_corpus_far_smaller_than_the_tokens_planned_is_said_with_its_repeats():
    """Issue 60's run: 16 steps a pass, about six passes planned."""
    node = Node(lambda size: 0.05 + size.flops * 2e-9, 45, 6.0)
    corpus = 16 * CPU_STEP_TOKENS
    choice = node.choose(CPU_SIZES, CPU_STEP_TOKENS, corpus)
    passes = choice.best.steps / 16
    assert passes > 5
    note = describe(choice, corpus)[-1]
    assert note.startswith(f"note: the corpus holds 0.07M tokens a pass, fewer than the "
                           f"{choice.best.tokens / 1e6:.2f}M planned: they repeat "
                           f"{passes:.1f} times, worth ")  # fmt: skip


def test_where_no_step_fits_one_line_says_so_and_predicts_nothing():
    node = Node(lambda size: 30.0 + size.flops * 1e-6, 60, 6.0)
    lines = describe(node.choose(GPU_SIZES, GPU_STEP_TOKENS), None)
    assert len(lines) == 1 and "inf" not in lines[0] and " 0 steps" not in lines[0]
    assert re.fullmatch(r"model size: depth 1: no candidate's step \(d1 \d+\.\d{3} s\) fits the "
                        r"time left after timing them \(\d+\.\d s\), so nothing is predicted",
                        lines[0])  # fmt: skip


def test_auto_weighs_a_tied_run_with_its_embedding_counted_once():
    flags = ["--model-size", "auto", "--time-budget", "10m"]
    untied = family_sizes(parse_train_args(flags), 8192)
    tied = family_sizes(parse_train_args([*flags, "--tie-embeddings"]), 8192)
    assert len(tied) == 64 and [s.depth for s in tied] == list(range(1, 65))
    assert (untied[0].parameters, tied[0].parameters) == (1_102_016, 577_728)
    assert all(u.parameters - t.parameters == 8192 * 64 * u.depth for u, t in zip(untied, tied))
