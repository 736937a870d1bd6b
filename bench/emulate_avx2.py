"""Run anything (the suite, a benchmark) as on a CPU with AVX2 only, on a CPU with more.

    python bench/emulate_avx2.py install     # into this interpreter's environment
    env $(python bench/emulate_avx2.py env) make test
    python bench/emulate_avx2.py remove

``install`` puts a start-up hook into the environment's site-packages (every process of the venv
runs it, whatever PYTHONPATH a test gives its subprocesses); it acts only where
LLAMA_DDP_EMULATE_AVX2=1. Then, once torch is imported, its probes of AVX512-BF16 and AMX say no
(``--dtype auto`` trains in fp32, as on an AVX2-only CPU) and oneDNN is off, so a bf16 matmul
takes ATen's emulated kernel (here ~12x fp32's time at 256 x 256, as bf16 is on such a CPU).
``env`` prints the variables, the hook's and the ones that hold torch's kernels, MKL and oneDNN
to AVX2 (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA). Not emulated: the
AVX2 machine's clock and caches, and inductor's generated code (it probes the CPU itself)."""

import sys
import sysconfig
from pathlib import Path

ENV = {
    "LLAMA_DDP_EMULATE_AVX2": "1",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
MODULE = "_llama_ddp_emulate_avx2"
HOOK = '''"""bench/emulate_avx2.py's start-up hook: with LLAMA_DDP_EMULATE_AVX2=1, torch's bf16
probes say no and oneDNN is off once torch is imported."""
import importlib.abc
import importlib.util
import os
import sys


class _AfterTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torch")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.cpu._is_avx512_bf16_supported = lambda: False
            module.cpu._is_amx_tile_supported = lambda: False
            module.backends.mkldnn.enabled = False

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("LLAMA_DDP_EMULATE_AVX2") == "1":
    sys.meta_path.insert(0, _AfterTorch())
'''


def main(argv: list[str]) -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    files = (site / f"{MODULE}.py", site / f"{MODULE}.pth")
    if argv == ["install"]:
        files[0].write_text(HOOK)
        files[1].write_text(f"import {MODULE}\n")
        print(f"installed into {site}")
    elif argv == ["remove"]:
        for path in files:
            path.unlink(missing_ok=True)
        print(f"removed from {site}")
    elif argv == ["env"]:
        print(" ".join(f"{k}={v}" for k, v in ENV.items()))
    else:
        print("usage: python bench/emulate_avx2.py install | env | remove", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
