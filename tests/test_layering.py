"""The layering rules of docs/layout.md ("What may import what"), checked on the whole package as
it is: no import cycle, nothing imports a layer above its own, the edge (files/, attention_plan/)
imports only errors, importing the data layer or the model loads nothing above it, the commands
stand apart from the library (which neither imports them nor reads a command line), each has a
console script, and every folder stays small enough to read."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from llama_ddp.train.cli import tomllib  # tomli before Python 3.11
from tests.helpers.runs import ROOT

PACKAGE = ROOT / "llama_ddp"
# Bottom up; a module may import its own layer and the ones before it.
LAYERS = ["", "attention_plan", "files", "model", "data", "distributed", "checkpoint", "interop",
          "eval", "generation", "train"]  # fmt: skip
# The command modules (`python -m llama_ddp.<name>`): argument parsing, printing, exit codes.
COMMANDS = {"generate", "evaluate", "plot", "export", "plan"}
# The train command reads its flag table in train/ (cli.py; __main__.py runs it); errors.py holds
# the parser and the exit-code wrapper every command shares.
COMMAND_LINE = {f"llama_ddp.{c}" for c in COMMANDS} | {
    "llama_ddp.train.cli",
    "llama_ddp.train.__main__",
    "llama_ddp.errors",
}


def layer(module: str) -> str:
    """'llama_ddp.data.cache.read' -> 'data'; a top-level module is layer ''."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else ""


def imports() -> dict[str, set[str]]:
    """Every module of the package and the package modules it imports (TYPE_CHECKING included)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        here = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("llama_ddp"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    is_module = (PACKAGE.parent / (full.replace(".", "/") + ".py")).is_file()
                    here.add(full if is_module else node.module)
            elif isinstance(node, ast.Import):
                here |= {a.name for a in node.names if a.name.startswith("llama_ddp.")}
        found[name] = here - {name}
    return found


def test_no_module_imports_a_layer_above_its_own():
    upward = []
    for module, targets in imports().items():
        if module.split(".")[-1] in COMMANDS and layer(module) == "":
            continue  # a command module sits on top of the layer whose command it runs
        for target in targets:
            if LAYERS.index(layer(target)) > LAYERS.index(layer(module)):
                upward.append(f"{module} -> {target}")
    assert upward == []


def test_there_is_no_import_cycle():
    graph = imports()
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_edge_imports_only_errors():
    """files/ and attention_plan/ (the layers under the model) import nothing of the package
    but errors and their own modules."""
    wider = {
        f"{module} -> {target}"
        for module, targets in imports().items()
        if layer(module) in ("files", "attention_plan")
        for target in targets
        if target != "llama_ddp.errors" and layer(target) != layer(module)
    }
    assert wider == set()


@pytest.mark.parametrize(
    "modules, allowed",
    [
        (
            ["data.pipeline", "data.mixture", "data.cache.builder"],
            ("attention_plan", "files", "data"),
        ),
        (["model.llama", "model.loss", "model.weights"], ("attention_plan", "files", "model")),
    ],
    ids=["data", "model"],
)
def test_importing_a_layer_loads_nothing_above_it(modules, allowed):
    """What a layer's modules bring in when imported, lazy imports and the package's top
    included: the data layer loads no model, distributed or training module; the model nothing
    of data, distribution or training."""
    code = (
        f"import sys, {', '.join('llama_ddp.' + m for m in modules)}\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('llama_ddp'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    loaded = done.stdout.split()
    assert f"llama_ddp.{modules[0]}" in loaded
    above = [
        m for m in loaded if layer(m) not in ("", *allowed) or m[len("llama_ddp.") :] in COMMANDS
    ]
    assert above == []


def modules() -> dict[str, ast.Module]:
    """Every module of the package by its dotted name (a package by its own)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = ast.parse(
            path.read_text()
        )
    return found


def test_no_library_module_imports_a_command():
    commands = {f"llama_ddp.{c}" for c in COMMANDS} | {"llama_ddp.train.cli"}
    wrong = {
        f"{module} -> {target}"
        for module, targets in imports().items()
        if module not in COMMAND_LINE
        for target in targets & commands
    }
    assert wrong == set()


def test_only_the_commands_read_a_command_line():
    """argparse, and sys.argv, belong to the command modules: a library function takes values."""
    readers = set()
    for module, tree in modules().items():
        for node in ast.walk(tree):
            imported = isinstance(node, ast.Import) and any(
                a.name == "argparse" for a in node.names
            )
            imported |= isinstance(node, ast.ImportFrom) and node.module == "argparse"
            argv = isinstance(node, ast.Attribute) and node.attr == "argv"
            if imported or argv:
                readers.add(module)
    assert readers - COMMAND_LINE == set()
    assert {"llama_ddp.generate", "llama_ddp.train.cli"} <= readers  # the check sees them


def test_every_command_has_a_console_script_and_a_module_form():
    """llama-ddp-<name> for each of the six, pointing at a main that exists, and each module
    runnable as ``python -m``."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    scripts = pyproject["project"]["scripts"]
    assert set(scripts) == {f"llama-ddp-{c}" for c in (*COMMANDS, "train")}
    for script, target in scripts.items():
        module, _, function = target.partition(":")
        assert callable(getattr(importlib.import_module(module), function)), script
    for command in COMMANDS:
        assert 'if __name__ == "__main__":' in (PACKAGE / f"{command}.py").read_text()


def test_the_package_is_small_enough_to_read():
    """At the top, one module per command and at most 4 others; 12 in a folder (its
    subfolders apart); none over 400 lines."""
    folders: dict[str, list[Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        folders.setdefault(str(path.parent.relative_to(PACKAGE)), []).append(path)
    assert len([p for p in folders.pop(".") if p.stem not in COMMANDS]) <= 4
    assert {k: len(v) for k, v in folders.items() if len(v) > 12} == {}
    long = {
        str(p): n for p in PACKAGE.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400
    }
    assert long == {}
