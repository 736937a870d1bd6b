"""llama_ddp/__init__.py: names imported on first use, and MKL's vector math warmed from one
thread as torch is imported (its first call made by two threads at once can run MKL's
low-accuracy cosine: RoPE tables off by 1.5e-4 on some Intel Xeons)."""

import json
import os
import subprocess
import sys

from tests.helpers.runs import ROOT

# Each child's first math is the RoPE tables of the base preset (2048 x 64: many threads' work),
# checked against float64 cosines and sines of the same float32 angles.
FIRST_MATH = """
import json
import torch
from llama_ddp.model.config import preset
from llama_ddp.model.llama import rope_tables
config = preset("base", vocab_size=256)
cos, sin = rope_tables(config)
d = config.head_dim
inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
positions = torch.arange(config.max_position_embeddings, dtype=torch.int64).float()
freqs = torch.outer(positions, inv_freq)
emb = torch.cat((freqs, freqs), dim=-1).double()
print(json.dumps([(cos.double() - emb.cos()).abs().max().item(),
                  (sin.double() - emb.sin()).abs().max().item(), cos.shape[0]]))
"""


def _python(code: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_the_rope_tables_are_exact_as_a_fresh_processs_first_math():
    """6 fresh processes with 2 OpenMP threads each (the race showed in 4 of 15 such runs):
    every table within 2e-7 of float64's (float32's high-accuracy cos is within ~1 ulp, 6e-8
    near 1; the low-accuracy one was off by up to 1.5e-4)."""
    children = [_python(FIRST_MATH, OMP_NUM_THREADS="2") for _ in range(6)]
    for child in children:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
        cos_error, sin_error, positions = json.loads(out)
        assert positions == 2048
        assert cos_error < 2e-7 and sin_error < 2e-7, (cos_error, sin_error)


def test_importing_the_package_warms_the_vector_math_once_torch_is_imported():
    """Before torch (a tokenizer worker imports no torch: nothing is done) or after it."""
    before = (
        "import sys, llama_ddp\n"
        "assert 'torch' not in sys.modules and not llama_ddp.warmed\n"
        "import torch\n"
        "print(llama_ddp.warmed)"
    )
    after = "import torch, llama_ddp\nprint(llama_ddp.warmed)"
    for child in [_python(before), _python(after)]:
        out, err = child.communicate(timeout=120)
        assert child.returncode == 0, err[-2000:]
        assert out.strip() == "True"


def test_a_torch_older_than_2_9_is_one_line_naming_the_version():
    """Issue 53, item 1: torch.optim.Muon is torch 2.9's; with an older torch the package says
    so on import, and train.py in one line, exit 2 (before, an ImportError deep in muon.py)."""
    import llama_ddp

    assert llama_ddp.torch_problem("2.8.0+cu128") == (
        "llama_ddp needs torch 2.9 or later, this environment has torch 2.8.0+cu128 (pip install "
        "'torch>=2.9', or TORCH_VERSION=2.13.0 make install)"
    )
    assert (
        llama_ddp.torch_problem("2.9.0") is None and llama_ddp.torch_problem("2.13.0+cpu") is None
    )
    assert llama_ddp.torch_problem("2.10.0a0+git1234") is None
    old = (
        "import importlib.metadata as m, runpy, sys; real = m.version; "
        "m.version = lambda n: '2.5.1' if n == 'torch' else real(n); "
        f"sys.argv = ['train.py', '--help']; runpy.run_path({str(ROOT / 'train.py')!r}, "
        "run_name='__main__')"
    )
    result = subprocess.run([sys.executable, "-c", old], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (
        "error: llama_ddp needs torch 2.9 or later, this environment has torch 2.5.1 (pip install "
        "'torch>=2.9', or TORCH_VERSION=2.13.0 make install)\n"
    )
