"""The package's layout: dependencies run one way, the simulator needs no torch, files stay
small, folders stay rooms a newcomer can take in.

docs/design.md ("Architecture") states the direction; these tests keep it true.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "commfuse"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = path.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The commfuse modules ``name`` imports anywhere in its file (inside functions too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            # a module importing its own package (its __init__) is not a dependency cycle
            if t and t != name and not name.startswith(t + "."):
                found.add(t)
    return found


def test_no_import_cycles():
    modules = _modules()
    graph = {m: _imports(m, p, modules) for m, p in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str):
        state[m] = 1
        path.append(m)
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(dep):] + [dep]))
            if dep not in state:
                visit(dep)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_top_level_is_small_and_files_are_short():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 6, top
    long = {str(p.relative_to(PKG)): n for p in PKG.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 350}
    assert not long, long


def test_the_simulator_and_planner_run_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from commfuse.sim import preset, simulate_op\n"
            "from commfuse.sim.step import simulate_step\n"
            "from commfuse.parallel.config import ParallelDims\n"
            "import commfuse, commfuse.sim.plan, commfuse.sim.plan.cli, commfuse.sim.calibrate\n"
            "r = simulate_op('matmul_rs', 'commfuse', 4, (8192, 4096, 4096), 2, preset('h100-nvlink'))\n"
            "s = simulate_step('7b', ParallelDims(tp=8, dp=2, method='auto'), 'h100-nvlink', "
            "seq=4096, batch=2)\n"
            "print(r.total_s > 0, s.step_s > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


# What each room of the simulator may import (inside functions too): the op timeline
# (commfuse/sim/*.py) only the pure layer, never the step or the planner built on it; the
# step also the model and layout configs; the planner also the step.
SIM_ROOMS = {
    "commfuse.sim": ("commfuse.schedule", "commfuse.trace", "commfuse.sim"),
    "commfuse.sim.step": ("commfuse.schedule", "commfuse.trace", "commfuse.sim",
                          "commfuse.models.config", "commfuse.parallel.config"),
    "commfuse.sim.plan": ("commfuse.schedule", "commfuse.trace", "commfuse.sim",
                          "commfuse.models.config", "commfuse.parallel.config"),
}
SUBPACKAGES = ("commfuse.sim.step", "commfuse.sim.plan")


def _room(module: str) -> str:
    return next((p for p in SUBPACKAGES if module == p or module.startswith(p + ".")),
                "commfuse.sim")


def _allowed(room: str, dep: str) -> bool:
    if room == "commfuse.sim" and _room(dep) != "commfuse.sim":
        return False  # the op timeline never imports the step or the planner
    if room == "commfuse.sim.step" and _room(dep) == "commfuse.sim.plan":
        return False
    return any(dep == a or dep.startswith(a + ".") for a in SIM_ROOMS[room])


def _third_party(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"commfuse", "__future__"} - set(sys.stdlib_module_names)


def test_the_simulator_rooms_import_one_way_and_no_torch():
    modules = _modules()
    sim = {m: p for m, p in modules.items() if m == "commfuse.sim" or m.startswith("commfuse.sim.")}
    assert set(SUBPACKAGES) <= set(sim)
    for m, path in sim.items():
        room = _room(m)
        bad = sorted(d for d in _imports(m, path, modules) if not _allowed(room, d))
        assert not bad, f"{m} ({room}) imports {bad}"
        assert not _third_party(path), f"{m} imports {_third_party(path)} (the simulator is pure)"


def _differ_by_affix(a: str, b: str) -> bool:
    return a != b and (a.startswith(b + "_") or a.endswith("_" + b)
                       or b.startswith(a + "_") or b.endswith("_" + a))


def test_simulator_file_names_do_not_differ_only_by_a_prefix_or_suffix():
    stems = sorted({p.stem for p in (PKG / "sim").rglob("*.py") if p.stem != "__init__"})
    pairs = [(a, b) for i, a in enumerate(stems) for b in stems[i + 1:] if _differ_by_affix(a, b)]
    assert not pairs, pairs


def test_every_folder_is_a_room_of_at_most_15_modules():
    big = {str(d.relative_to(PKG.parent)): n for d in [PKG, *PKG.rglob("*/")]
           if d.is_dir() and (n := len(list(d.glob("*.py")))) > 15}
    assert not big, big


def test_import_commfuse_is_lazy():
    code = "import sys, commfuse, commfuse.sim; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=PKG.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
