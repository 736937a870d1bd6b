"""The figures of a GPU check (scripts/gpu_check.sh), one line each, from its results folder.

    python scripts/gpu_figures.py RESULTS [LOGS]

Reads what each part wrote (run-defaults.json, the tests' junit XML, kernels.json, contenders.json,
optim.json, loss.json, loss-128k.json, run-adamw.json; a missing or broken one is said, never
guessed) and prints
MFU and tokens/s at the defaults, the tests' counts and every failing test's name and first line,
each attention backend's time and what auto took, ours against transformers, the optimizer step
alone and its share of a defaults step, the loss's peaks and times.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def _load(folder: Path, name: str) -> dict | None:
    try:
        return json.loads((folder / name).read_text())
    except (OSError, ValueError):
        return None


def run_line(name: str, doc: dict | None) -> tuple[list[str], float | None]:
    if doc is None:
        return [f"{name}: no result"], None
    lines, step_s = [], None
    for label, r in doc["runs"].items():
        step_s = r.get("step_s")
        memory = r.get("max_memory_allocated")
        lines.append(
            f"{name} [{label}]: {r['tokens_per_s']:,.0f} tokens/s, MFU {100 * r['mfu']:.1f}%, "
            f"step {1e3 * (step_s or 0):.1f} ms, first step at {r['first_step_s']:.1f} s "
            f"(compiling ~{r.get('compile_s') or 0:.1f} s), data wait "
            f"{100 * (r.get('data_wait_share') or 0):.1f}%, peak "
            f"{(memory or 0) / 2**30:.1f} GiB"
        )
        lines += [f"  {b}" for b in r.get("banner", [])]
    return lines, step_s


def tests_lines(path: Path) -> list[str]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return ["tests: no junit result"]
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    passed = count["tests"] - count["failures"] - count["errors"] - skipped
    lines = [
        f"tests: {passed} passed, {count['failures']} failed, {count['errors']} errors, "
        f"{skipped} skipped"
    ]
    reasons: dict[str, int] = {}
    for case in root.iter("testcase"):
        for bad in list(case.findall("failure")) + list(case.findall("error")):
            first = (bad.get("message") or "").splitlines()[:1]
            lines.append(f"  FAILED {case.get('classname')}::{case.get('name')}: {first}"[:300])
        for skip in case.findall("skipped"):
            reason = skip.get("message", "")[:120]
            reasons[reason] = reasons.get(reason, 0) + 1
    lines += [f"  skipped {n}: {reason}" for reason, n in reasons.items()]
    return lines


def kernels_lines(doc: dict | None) -> list[str]:
    if doc is None:
        return ["kernels: no result"]
    lines = []
    for label, rows in doc.items():
        if not isinstance(rows, dict):
            continue
        cells = []
        for name, r in rows.items():
            if "ms" in r:
                again = (
                    f", new layout {r['first_ms']} / again {r['again_ms']} ms"
                    if ("first_ms" in r)
                    else ""
                )
                cells.append(f"{name} {r['ms']:.2f} ms ({r['tflops']} TFLOP/s{again})")
            elif name != "auto":
                cells.append(f"{name}: {next(iter(r.values()))}"[:140])
        lines.append(f"kernels {label}: " + "; ".join(cells))
        if "auto" in rows:
            took = rows["auto"].get("choice_s")
            lines.append(f"  auto takes {rows['auto']['takes']} (choosing took {took:.1f} s)")
    return lines


def contenders_lines(doc: dict | None) -> list[str]:
    if doc is None:
        return ["contenders: no result"]
    cells = [
        f"{n} {r['tokens_per_s']:,.0f} tokens/s MFU {100 * (r['mfu'] or 0):.1f}% "
        f"peak {r.get('max_memory_allocated', 0) / 2**30:.1f} GiB"
        for n, r in doc["contenders"].items()
    ]
    ratios = ", ".join(f"{k} {v:.2f}x" for k, v in doc["ratios"].items())
    return [f"contenders: {'; '.join(cells)}; {ratios}"]


def optim_lines(doc: dict | None, step_s: float | None) -> list[str]:
    if doc is None:
        return ["optim: no result"]
    cells = []
    for name, r in doc["contenders"].items():
        share = f", {100 * r['fastest_s'] / step_s:.1f}% of a defaults step" if step_s else ""
        cells.append(f"{name} {1e3 * r['fastest_s']:.2f} ms{share}")
    return ["optim: " + "; ".join(cells)]


def loss_lines(doc: dict | None, name: str = "loss") -> list[str]:
    if doc is None:
        return [f"{name}: no result"]
    return [
        f"{name} (vocab {doc['shape']['vocab']}, {doc['shape']['tokens']} tokens): "
        + "; ".join(
            f"{n} peak +{r['peak_bytes'] / 2**20:.0f} MiB {1e3 * r['fastest_s']:.2f} ms"
            for n, r in doc["contenders"].items()
        )
    ]


def figures(results: Path) -> list[str]:
    """Every part's lines; a part whose result cannot be read says so, the others still come."""
    step_s: list[float | None] = [None]

    def mfu() -> list[str]:
        lines, step_s[0] = run_line("mfu", _load(results, "run-defaults.json"))
        return lines

    parts = [
        ("mfu", mfu),
        ("tests", lambda: tests_lines(results / "tests.xml")),
        ("kernels", lambda: kernels_lines(_load(results, "kernels.json"))),
        ("contenders", lambda: contenders_lines(_load(results, "contenders.json"))),
        ("optim", lambda: optim_lines(_load(results, "optim.json"), step_s[0])),
        ("loss", lambda: loss_lines(_load(results, "loss.json"))),
        ("loss-128k", lambda: loss_lines(_load(results, "loss-128k.json"), "loss-128k")),
        ("adamw", lambda: run_line("adamw", _load(results, "run-adamw.json"))[0]),
    ]
    lines = []
    for name, part in parts:
        try:
            lines += part()
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            lines.append(f"{name}: its result could not be read ({type(exc).__name__}: {exc})")
    return lines


def main(argv: list[str]) -> int:
    print("\n".join(figures(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
