"""The documentation's commands run and its links resolve.

Every fenced ```bash and ```python block of README.md and examples/README.md runs, unless its
first line starts with ``# doc-test: skip`` (followed by why); ```console blocks are output,
not run. A python block runs as a file (so ``if __name__ == "__main__"`` and spawned ranks
work), under ``torch.distributed.run --nproc-per-node N`` if its first line is
``# doc-test: torchrun N``. A bash block runs its command lines that start with
``commfuse``, ``python`` or ``.venv/bin/...`` (the latter mapped to this interpreter's bin
directory), in one shell with ``set -e``; a line that creates a venv or pip-installs is the
setup, not run (CI makes the venv itself), nor are other commands. Blocks run in a temporary
directory that links to the repository's top-level entries, so relative paths (scripts/,
examples/) resolve and what a command writes (a checkpoint directory) stays out of the tree.

Every relative link of README.md, examples/README.md and docs/**/*.md names an existing file
or directory (anchors are not checked).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS_WITH_COMMANDS = ("README.md", "examples/README.md")
BIN = Path(sys.executable).parent
RUNNABLE = ("commfuse", "python", "python3")
SETUP = re.compile(r"-m venv\b|\bpip install\b")
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


def _blocks() -> list:
    """``pytest.param(lang, text, id="FILE:LINE")`` per bash / python block."""
    out = []
    for name in DOCS_WITH_COMMANDS:
        path = ROOT / name
        if not path.exists():
            continue
        doc = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(doc):
            if m.group(1) in ("bash", "python"):
                line = doc.count("\n", 0, m.start()) + 1
                out.append(pytest.param(m.group(1), m.group(2), id=f"{name}:{line}"))
    return out


def _commands(script: str) -> list[str]:
    """The lines of a bash block that run: continuations joined, setup and other tools left
    out, ``.venv/bin/X`` mapped to this interpreter's bin directory."""
    kept = []
    for line in script.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        if not words or SETUP.search(line):
            continue
        line = re.sub(r"(?<![\w/.])\.venv/bin/", f"{BIN}/", line)
        first = Path(shlex.split(line, comments=True)[0])
        if first.name in RUNNABLE and (first.parent == Path(".") or first.parent == BIN):
            kept.append(line)
    return kept


def _sandbox(tmp: Path) -> Path:
    """A working directory whose entries link to the repository's top-level ones."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def _run(argv: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"{shlex.join(argv)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("lang, text", _blocks())
def test_doc_block_runs(lang, text, tmp_path):
    first = text.split("\n", 1)[0].strip()
    if first.startswith("# doc-test: skip"):
        pytest.skip(first)
    cwd = _sandbox(tmp_path)
    if lang == "python":
        block = tmp_path / "doc_block.py"
        block.write_text(text, encoding="utf-8")
        torchrun = re.fullmatch(r"# doc-test: torchrun (\d+)", first)
        argv = [sys.executable, str(block)]
        if torchrun:
            argv[1:1] = ["-m", "torch.distributed.run", "--standalone",
                         f"--nproc-per-node={torchrun.group(1)}"]
        _run(argv, cwd)
        return
    commands = _commands(text)
    if not commands:
        pytest.skip("no commfuse / python command in this block")
    _run(["bash", "-euo", "pipefail", "-c", "\n".join(commands)], cwd)


def test_bash_lines_that_run():
    """What `_commands` keeps: commfuse and python lines, mapped; not setup, not other tools."""
    script = ("python3 -m venv .venv && .venv/bin/pip install -q -e .\n"
              ".venv/bin/commfuse train --steps 5 \\\n    --link loopback  # a comment\n"
              "commfuse demo\n# only a comment\nls out/\n.venv/bin/python -c 'print(1)'\n")
    assert _commands(script) == [f"{BIN}/commfuse train --steps 5      --link loopback  "
                                 "# a comment", "commfuse demo", f"{BIN}/python -c 'print(1)'"]


LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
CODE = re.compile(r"^```.*?^```[ \t]*$|`[^`\n]*`", re.MULTILINE | re.DOTALL)


def _markdown_files() -> list[Path]:
    files = [ROOT / name for name in DOCS_WITH_COMMANDS if (ROOT / name).exists()]
    return files + sorted((ROOT / "docs").rglob("*.md"))


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file (outside code) that name no existing path."""
    text = CODE.sub("", path.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text) + REFERENCE.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue  # a URL (http:, mailto:) or an anchor in this page
        where = target.split("#", 1)[0]
        if not (path.parent / where).exists():
            broken.append(target)
    return broken


@pytest.mark.parametrize("path", _markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_broken_links_finds_what_it_should(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a) [web](https://x.org/y) [anchor](#a)\n"
                    "[gone](missing.md) ![img](gone.png) `[code](not-a-link.md)`\n"
                    "```\n[fenced](nor-this.md)\n```\n[ref]: ref-missing.md\n")
    assert broken_links(page) == ["missing.md", "gone.png", "ref-missing.md"]
