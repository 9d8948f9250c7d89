"""The documentation's commands run and its links resolve.

Every fenced ```bash and ```python block of the pages (README.md, examples/README.md,
CONTRIBUTING.md, scripts/README.md, docs/**/*.md) runs, unless its first line says otherwise;
```console blocks are output, not run. The first line of a block may be:

- ``# doc-test: skip (why)``: not run (a GPU, root, minutes, a fragment). Its ``commfuse``
  and ``python -m commfuse...`` lines must still parse: their subcommands and flags exist
  (argparse only, nothing runs); a python block must compile.
- ``# doc-test: torchrun N``: a python block runs under ``torch.distributed.run
  --nproc-per-node N``.

A python block runs as a file (so ``if __name__ == "__main__"`` and spawned ranks work). A bash
block runs its command lines that start with ``commfuse``, ``python`` or ``.venv/bin/...``
(the latter mapped to this interpreter's bin directory): in this process where they are all
plain ``commfuse`` lines (no interpreter start), else in one shell with ``set -e``. A line
that creates a venv or pip-installs is the setup, not run (CI makes the venv itself), nor are
other commands. A block that is a shell script rather than a list of commands (a loop, a
variable, a quote across lines) runs whole, in one shell. Blocks run in a temporary directory
that links to the repository's top-level entries, so relative paths (scripts/, examples/)
resolve and what a command writes (a checkpoint directory, out/) stays out of the tree.

Every relative link of the pages names an existing file or directory (anchors not checked).
"""

import argparse
import contextlib
import io
import os
import re
import runpy
import shlex
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "examples/README.md", "CONTRIBUTING.md", "scripts/README.md")
BIN = Path(sys.executable).parent
RUNNABLE = ("commfuse", "python", "python3")
SETUP = re.compile(r"-m venv\b|\bpip install\b")
SHELL = re.compile(r"[|;&<>`$]|^\w+=")  # pipes, lists, redirects, expansion, env prefixes
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
LIMIT_S = 300  # a block slower than this is not cheap: mark it skip, with why
FORWARDED = ("simulate", "plan", "check-gpu")  # cli._forwarding_parser: their module parses
SCRIPT = re.compile(r"^\s*(for|while|until|if|case|function)\b|^\s*\w+=", re.MULTILINE)


def _pages() -> list[Path]:
    return ([ROOT / name for name in PAGES if (ROOT / name).exists()]
            + sorted((ROOT / "docs").rglob("*.md")))


def _blocks(skipped: bool) -> list:
    """``pytest.param(lang, text, id="FILE:LINE")`` per bash / python block that runs (or,
    with ``skipped``, per block marked skip)."""
    out = []
    for path in _pages():
        doc = path.read_text(encoding="utf-8")
        for m in FENCE.finditer(doc):
            if m.group(1) in ("bash", "python"):
                line = doc.count("\n", 0, m.start()) + 1
                skip = m.group(2).startswith("# doc-test: skip")
                if skip == skipped:
                    name = path.relative_to(ROOT)
                    out.append(pytest.param(m.group(1), m.group(2), id=f"{name}:{line}"))
    return out


def _is_script(text: str) -> bool:
    """Whether a bash block is a shell script (a loop, a variable, a quote across lines)
    rather than command lines that each run alone."""
    if SCRIPT.search(text):
        return True
    try:
        for line in text.replace("\\\n", " ").splitlines():
            shlex.split(line, comments=True)
    except ValueError:  # a quote open at the end of a line
        return True
    return False


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


def _in_process(commands: list[str]) -> list[list[str]] | None:
    """Each line's ``commfuse`` arguments where every line is a plain ``commfuse ...``."""
    argvs = []
    for line in commands:
        words = shlex.split(line, comments=True)
        if Path(words[0]).name != "commfuse" or SHELL.search(line.split("#", 1)[0]):
            return None
        argvs.append(words[1:])
    return argvs


def _sandbox(tmp: Path) -> Path:
    """A working directory whose entries link to the repository's top-level ones."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", ".venv"):
            (tmp / entry.name).symlink_to(entry)
    return tmp


def _run(argv: list[str], cwd: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    try:
        proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"over {LIMIT_S} s: mark the block `# doc-test: skip (why)`")
    assert proc.returncode == 0, (f"{shlex.join(argv)} exited {proc.returncode}:\n"
                                  f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("lang, text", _blocks(skipped=False))
def test_doc_block_runs(lang, text, tmp_path, monkeypatch, command):
    first = text.split("\n", 1)[0].strip()
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
    if _is_script(text):
        script = re.sub(r"(?<![\w/.])\.venv/bin/", f"{BIN}/", text)
        _run(["bash", "-euo", "pipefail", "-c", script], cwd)
        return
    commands = _commands(text)
    if not commands:
        pytest.skip("no commfuse / python command in this block")
    argvs = _in_process(commands)
    if argvs is None:
        _run(["bash", "-euo", "pipefail", "-c", "\n".join(commands)], cwd)
        return
    monkeypatch.chdir(cwd)
    for argv in argvs:
        ran = command(*argv)
        assert ran.returncode in (0, None), (f"commfuse {shlex.join(argv)} exited "
                                             f"{ran.returncode}:\n{ran.stdout[-4000:]}\n"
                                             f"{ran.stderr[-4000:]}")


class _Parsed(Exception):
    """A command's arguments parsed: it stops there, before doing anything."""


def parse_error(words: list[str]) -> str | None:
    """What argparse says is wrong with a ``commfuse ...`` or ``python -m commfuse...``
    command line (``words`` without the program), None if its arguments parse. Nothing runs:
    the parse of the subcommand's own arguments raises instead of returning."""
    from commfuse import cli

    parse_args = argparse.ArgumentParser.parse_args

    def parse_only(parser, args=None, namespace=None):
        ns = parse_args(parser, args, namespace)
        if parser.prog == "commfuse" and getattr(ns, "command", None) in FORWARDED:
            return ns  # the subcommand's module parses its arguments next
        raise _Parsed

    err = io.StringIO()
    with (mock.patch.object(argparse.ArgumentParser, "parse_args", parse_only),
          contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO())):
        try:
            if words[:1] == ["-m"]:
                with mock.patch.object(sys, "argv", [words[1], *words[2:]]):
                    runpy.run_module(words[1], run_name="__main__", alter_sys=False)
            else:
                cli.main(words)
        except _Parsed:
            return None
        except SystemExit as e:
            return None if e.code in (0, None) else err.getvalue().strip() or f"exit {e.code}"
    return "ran without parsing its arguments"


def _checkable(text: str) -> list[list[str]]:
    """The ``commfuse`` and ``python -m commfuse...`` lines of a bash block, as words without
    the program, after the block's own ``NAME="..."`` variables; lines with other expansions
    (a loop's variable) are left out."""
    names, lines = {}, []
    for line in text.replace("\\\n", " ").splitlines():
        if m := re.fullmatch(r"\s*(\w+)=(\"[^\"]*\"|'[^']*')\s*", line):
            names[m.group(1)] = m.group(2)[1:-1]
            continue
        line = re.sub(r"\$(\w+)|\$\{(\w+)\}",
                      lambda v: names.get(v.group(1) or v.group(2), v.group(0)), line)
        try:
            words = shlex.split(line, comments=True)
        except ValueError:
            continue  # a quote that spans lines: not a plain command line
        while words and re.fullmatch(r"\w+=\S*", words[0]):
            words = words[1:]  # an environment prefix
        if not words or "$" in line.split("#", 1)[0]:
            continue
        program = Path(words[0]).name
        if program == "commfuse":
            lines.append(words[1:])
        elif program in RUNNABLE[1:] and words[1:2] == ["-m"] and words[2].startswith("commfuse"):
            lines.append(words[1:])
    return lines


@pytest.mark.parametrize("lang, text", _blocks(skipped=True))
def test_skipped_block_parses(lang, text):
    """A block too costly to run still names commands and flags that exist."""
    if lang == "python":
        compile(text, "<doc block>", "exec")
        return
    bad = {shlex.join(w): e for w in _checkable(text) if (e := parse_error(w))}
    assert not bad, bad


def test_parse_error_finds_what_it_should():
    assert parse_error(["train", "--steps", "5", "--link", "loopback"]) is None
    assert "--no-such-flag" in parse_error(["train", "--no-such-flag"])
    assert parse_error(["plan", "--model", "8b", "--devices", "8"]) is None
    assert "--no-such-flag" in parse_error(["simulate", "--no-such-flag"])
    assert parse_error(["bench", "op", "--nproc", "2"]) is None
    assert "invalid int" in parse_error(["bench", "op", "--nproc", "N"])
    assert parse_error(["-m", "commfuse.testbed.stress", "--runs", "1"]) is None
    assert "--no-such-flag" in parse_error(["-m", "commfuse.testbed.stress", "--no-such-flag"])
    assert parse_error(["no-such-command"]) is not None


def test_lines_checked_in_skipped_blocks():
    script = ('C="--nproc 3 --link 1gbit \\\n   --seq 8"\ncommfuse bench op $C --out x  # why\n'
              "for D in 1 2; do\n  commfuse simulate --d-model $D\ndone\n"
              "TORCH_X=1 .venv/bin/commfuse check-gpu --only loopback\n"
              "python -m commfuse.testbed.stress --runs 5\npython scripts/x.py --y\n"
              ".venv/bin/torchrun --nproc-per-node 2 -m commfuse.train\n")
    assert _checkable(script) == [
        ["bench", "op", "--nproc", "3", "--link", "1gbit", "--seq", "8", "--out", "x"],
        ["check-gpu", "--only", "loopback"], ["-m", "commfuse.testbed.stress", "--runs", "5"]]


def test_bash_lines_that_run():
    """What `_commands` keeps: commfuse and python lines, mapped; not setup, not other tools;
    and which blocks run in this process."""
    script = ("python3 -m venv .venv && .venv/bin/pip install -q -e .\n"
              ".venv/bin/commfuse train --steps 5 \\\n    --link loopback  # a comment\n"
              "commfuse demo\n# only a comment\nls out/\n.venv/bin/python -c 'print(1)'\n")
    kept = _commands(script)
    assert kept == [f"{BIN}/commfuse train --steps 5      --link loopback  # a comment",
                    "commfuse demo", f"{BIN}/python -c 'print(1)'"]
    assert _in_process(kept) is None  # the python line needs a shell
    assert _in_process(kept[:2]) == [["train", "--steps", "5", "--link", "loopback"], ["demo"]]
    assert _in_process(["commfuse plan --json x.json > log"]) is None
    assert not _is_script(script)
    assert _is_script('for m in a b; do python3 -c "\nprint(1)\n"; done\n')
    assert _is_script('C="--nproc 2"\ncommfuse bench op $C\n')


LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s*\[[^\]\n]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)
CODE = re.compile(r"^```.*?^```[ \t]*$|`[^`\n]*`", re.MULTILINE | re.DOTALL)


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


@pytest.mark.parametrize("path", _pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_broken_links_finds_what_it_should(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#a) [web](https://x.org/y) [anchor](#a)\n"
                    "[gone](missing.md) ![img](gone.png) `[code](not-a-link.md)`\n"
                    "```\n[fenced](nor-this.md)\n```\n[ref]: ref-missing.md\n")
    assert broken_links(page) == ["missing.md", "gone.png", "ref-missing.md"]
