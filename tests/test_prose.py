"""Every file path and module name the prose names exists: the Markdown pages, pyproject.toml,
the docstrings and comments of every Python file, the Makefile's and shell scripts' comments; so
the words stay true after a move."""

import ast
import io
import re
import subprocess
import tokenize
from collections.abc import Iterable, Iterator
from functools import cache
from pathlib import Path

from tests.helpers.runs import ROOT

PACKAGE = ROOT / "llama_ddp"
# A file path: folders, then a name with an extension (a code, doc or data file's).
EXTENSIONS = "py|md|toml|json|jsonl|pth|gguf|txt|sbatch|sh|png|yaml|yml|safetensors|csv|parquet"
PATH = re.compile(rf"(?<![\w./~$-])(?:[\w.-]+/)*[\w-][\w.-]*\.(?:{EXTENSIONS})(?![\w/-])")
# A folder path into the repo: `llama_ddp/...`, `tests/...`, `docs/...`, `bench/...`.
FOLDER = re.compile(r"(?<![\w./~$-])(?:llama_ddp|tests|docs|bench|scripts|tokenizer)/[\w/.-]*")
# A module (and maybe an attribute of it): `llama_ddp.train.optim`, `tests.helpers.runs`, or the
# path-and-attribute form `folder/module.NAME`.
MODULE = re.compile(r"(?<![\w./-])(?:llama_ddp|tests)(?:\.\w+)+")
PATH_ATTRIBUTE = re.compile(r"(?<![\w./~$-])((?:\w+/)+\w+)\.([A-Za-z_]\w*)(?![\w/(-])")
# A name under a capitalised placeholder folder (`OUT/llama_model.pth`, `RUN/hf/`) is a file a
# run writes, not one of the repo's; so is an absolute or home path.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*/|^[/~]")
# A bare data file's name (`metrics.jsonl`, `run.toml`) or a path outside the repo's folders
# (`data/code.jsonl`) names a file a run, an export, a user or a hub repository holds; a data file
# is checked where its path starts at a folder of the repo, unless .gitignore names it (then a
# command writes it: `bench/results/...`).
DATA_EXTENSIONS = set("toml json jsonl pth gguf txt png safetensors csv parquet".split())
REPO_FOLDERS = ("llama_ddp/", "tests/", "docs/", "bench/", "scripts/", "tokenizer/")
# Code files the prose names that are not files of this repo.
NOT_OURS = {
    "modeling_llama.py",  # transformers' Llama, which the model's names follow
    "convert_hf_to_gguf.py",  # llama.cpp's converter, which docs/llama-cpp.md compares with
    "torch/nn/attention/varlen.py",  # torch's varlen op, which attention_plan/varlen.py binds
    "textwrap.py",  # standard-library files the sample corpus is built from
    "warnings.py",
    "some_file.py",  # an example of a user's file (generate --perplexity some_file.py)
}


PROSE_FILES = (".py", ".md", ".sh", ".sbatch")


@cache
def sources(everything: bool = False) -> list[Path]:
    """The repo's files that hold prose (Markdown, Python, shell, pyproject.toml, the
    Makefile), or with `everything`, all of its files (untracked ones git does not ignore
    included)."""
    tracked = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    ).stdout.split()
    return [
        ROOT / name
        for name in tracked
        if everything
        or name.endswith(PROSE_FILES)
        or Path(name).name in ("Makefile", "pyproject.toml")
        if (ROOT / name).is_file()
    ]


def prose(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of a file's prose: all of a Markdown page or pyproject.toml; a Python
    file's docstrings and comments; a shell script's or the Makefile's comments."""
    text = path.read_text()
    if path.suffix in (".sh", ".sbatch") or path.name == "Makefile":
        lines = enumerate(text.splitlines(), 1)
        yield from ((n, line) for n, line in lines if line.lstrip().startswith("#"))
        return
    if path.suffix != ".py":
        yield from enumerate(text.splitlines(), 1)
        return
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring is not None:
                first = node.body[0].lineno
                for offset, line in enumerate(docstring.splitlines()):
                    yield first + offset, line
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


@cache
def repo_paths() -> frozenset[str]:
    """The repo's files and folders as a clean clone has them (nothing a run made)."""
    files = [str(path.relative_to(ROOT)) for path in sources(everything=True)]
    folders = {str(Path(name).parents[i]) for name in files for i in range(len(Path(name).parts))}
    return frozenset(files) | folders - {"."}


@cache
def defines(module_file: Path) -> frozenset[str]:
    """The names a module defines or imports at its top level; for a module with a lazy
    `__getattr__`, also the keys of its top-level dicts (the names it hands out)."""
    names = set()
    tree = ast.parse(module_file.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    if "__getattr__" in names:
        for node in tree.body:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return frozenset(names)


def bases(where: Path) -> list[Path]:
    """The folders a relative path may start from: the repo's, the package's, the naming
    file's."""
    return [ROOT, PACKAGE, where.parent]


def path_exists(written: str, where: Path) -> bool:
    name = written.rstrip("/").rstrip(".")
    if name in NOT_OURS:
        return True
    if name.rsplit(".", 1)[-1] in DATA_EXTENSIONS and not name.startswith(REPO_FOLDERS):
        return True
    if name.startswith(REPO_FOLDERS) and ignored(written):
        return True
    if "/" not in name:
        return any(Path(path).name == name for path in repo_paths())
    return any(
        str((base / name).resolve().relative_to(ROOT)) in repo_paths()
        for base in bases(where)
        if (base / name).resolve().is_relative_to(ROOT)
    )


@cache
def ignored(name: str) -> bool:
    """Whether .gitignore names the path: one that a command writes (bench/results/...)."""
    return subprocess.run(["git", "check-ignore", "-q", name], cwd=ROOT).returncode == 0


def module_exists(dotted: str) -> bool:
    """`a.b.c` is a module or package, or an attribute (a top-level name) of one."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        file = ROOT.joinpath(*parts[:cut])
        found = (
            file.with_suffix(".py") if file.with_suffix(".py").is_file() else file / "__init__.py"
        )
        if found.is_file():
            return cut == len(parts) or parts[cut] in defines(found)
    return False


def attribute_exists(folders: str, attribute: str, where: Path) -> bool:
    """`train/optim.SCHEDULES`: the module file exists and defines the name."""
    for base in bases(where):
        module = base / f"{folders}.py"
        if module.is_file():
            return attribute in defines(module)
    return False


def unresolved(lines: Iterable[tuple[int, str]], path: Path) -> Iterator[str]:
    """'file:line: name' for each name in `lines` (the prose of `path`) that does not resolve."""
    for line, text in lines:
        text = re.sub(r"https?://\S+", "", text)
        where = f"{path.relative_to(ROOT)}:{line}"
        for match in PATH.finditer(text):
            name = match.group()
            if not PLACEHOLDER.search(name) and not path_exists(name, path):
                yield f"{where}: {name}"
        for match in FOLDER.finditer(text):
            name = match.group()
            if not PATH.fullmatch(name) and not path_exists(name, path):
                yield f"{where}: {name}"
        for match in MODULE.finditer(text):
            if not module_exists(match.group().rstrip(".")):
                yield f"{where}: {match.group()}"
        for match in PATH_ATTRIBUTE.finditer(text):
            folders, attribute = match.groups()
            if attribute in EXTENSIONS.split("|") or PLACEHOLDER.search(folders):
                continue
            if path_exists(f"{folders}.py", path) and not attribute_exists(
                folders, attribute, path
            ):
                yield f"{where}: {match.group()}"


def test_every_path_and_module_the_prose_names_exists():
    missing = [hit for path in sources() for hit in unresolved(prose(path), path)]
    assert missing == []


def test_the_check_finds_a_missing_name():
    # Resolved against the repo as if this page were in docs/.
    page = ROOT / "docs" / "a-page-for-the-test.md"
    lines = [
        "see llama_ddp/data/tokenizer_gone.py and model_config.py",
        "python -m llama_ddp.nothing_here; train/optim.NO_SUCH_NAME",
        "fine: llama_ddp/data/, ../README.md, llama_ddp.train.optim.SCHEDULES, OUT/state.json",
        "../READ_ME.md",
    ]
    hits = [hit.split(": ", 1)[1] for hit in unresolved(enumerate(lines, 1), page)]
    assert hits == [
        "llama_ddp/data/tokenizer_gone.py",
        "model_config.py",
        "llama_ddp.nothing_here",
        "train/optim.NO_SUCH_NAME",
        "../READ_ME.md",
    ]
