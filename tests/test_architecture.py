"""The package structure as a test: no import cycle between speculant's packages, no import against the layering.

Every module under ``speculant/`` is read with :mod:`ast` (imports inside functions and under ``TYPE_CHECKING``
count: a deferred import still ties the packages together), relative imports resolved, and each import mapped to
the package it lands in (``speculant/models/llama.py`` is in ``models``; a top-level module such as
``speculant/errors.py`` is its own package).  The layering is the one of ``README.md`` ("Layout") and
``../shared/DESIGN.md`` ("Where the parts go now"): entry points (cli, serving, bench, training) on top, then the
engine, the drafters, the pure tensor packages (trees, verification, sampling), the runtime, and at the bottom the
model description and the kernels.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "speculant"

ENTRY_POINTS = {"cli", "arguments", "serving", "bench", "training"}
LEAVES = {"errors", "cpu", "paths"}
"""Top-level helpers below everything (they import nothing of speculant): anyone may import them."""
FORBIDDEN = {
    "models": {"runtime", "kernels", "drafters", "engine", "trees", "verification", "sampling"} | ENTRY_POINTS,
    "runtime": {"drafters", "engine"} | ENTRY_POINTS,
    "drafters": {"engine"} | ENTRY_POINTS,
    "trees": {"engine", "drafters", "runtime", "kernels"} | ENTRY_POINTS,
    "verification": {"engine", "drafters", "runtime", "kernels"} | ENTRY_POINTS,
    "sampling": {"engine", "drafters", "runtime", "kernels"} | ENTRY_POINTS,
    "engine": set(ENTRY_POINTS),
}
"""Package -> packages it must not import (at any depth of a function)."""
KERNELS_MAY_IMPORT = {"kernels"} | LEAVES
"""The kernels know no modules: they take buffers, shapes and paths, and import only the leaf helpers."""


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``speculant.models.llama`` ...)."""
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _package(module: str) -> str:
    """``speculant.models.llama`` -> ``models``; ``speculant.errors`` -> ``errors``; ``speculant`` -> ``speculant``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The speculant modules ``module`` imports (absolute and relative, at any depth of the file)."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    here = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[:len(here) - (node.level - 1)] if node.level > 1 else here
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            if name == "speculant" or name.startswith("speculant."):
                # the longest prefix that is a module of ours (``from .x import y``: y may be a module or a name)
                parts = name.split(".")
                while parts and ".".join(parts) not in known:
                    parts.pop()
                if parts:
                    out.add(".".join(parts))
    out.discard(module)
    return out


def _graph():
    known = _modules()
    edges = {}                                   # (from package, to package) -> an example "a imports b"
    for module, path in known.items():
        for target in _imports(module, path, known):
            a, b = _package(module), _package(target)
            if a != b and module != "speculant":
                edges.setdefault((a, b), f"{module} imports {target}")
    return edges


def test_the_reader_sees_imports_inside_functions_and_relative_ones(tmp_path):
    known = {"speculant.models.x": tmp_path / "x.py", "speculant.kernels.build": tmp_path / "b.py",
             "speculant.kernels": tmp_path / "k.py", "speculant.runtime.tune": tmp_path / "t.py"}
    src = tmp_path / "x.py"
    src.write_text("def f():\n    from ..kernels import build\n    import speculant.runtime.tune\n")
    assert _imports("speculant.models.x", src, known) == {"speculant.kernels", "speculant.kernels.build",
                                                         "speculant.runtime.tune"}


def test_no_forbidden_direction():
    bad = []
    for (a, b), example in sorted(_graph().items()):
        if a == "kernels" and b not in KERNELS_MAY_IMPORT:
            bad.append(example)
        elif b in FORBIDDEN.get(a, ()):
            bad.append(example)
        elif a in LEAVES:
            bad.append(f"{example} (a leaf helper imports nothing of speculant)")
    assert not bad, "imports against the layering:\n" + "\n".join(bad)


def test_nothing_imports_the_cli_module():
    users = [example for (a, b), example in _graph().items() if b == "cli"]
    assert not users, "only the entry point runs speculant/cli.py; shared helpers go to speculant/arguments.py:\n" \
        + "\n".join(users)


def test_no_cycle_between_packages():
    edges = _graph()
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycles = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                loop = stack[stack.index(nxt):] + [nxt]
                cycles.append(" -> ".join(loop) + ": " + "; ".join(edges[(x, y)] for x, y in zip(loop, loop[1:])))
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles between packages:\n" + "\n".join(cycles)


@pytest.mark.parametrize("module", ["speculant.models.llama", "speculant.kernels.decode_step",
                                    "speculant.runtime.executor"])
def test_the_layering_test_reads_real_modules(module):
    """The test is not vacuous: the modules it reasons about exist and have imports."""
    known = _modules()
    assert module in known and _imports(module, known[module], known)


MAX_FUNCTION_LINES = 80


def long_functions_without_a_reason(root: Path) -> list[str]:
    """``path:function (N lines)`` for every function of the ``.py`` files under ``root`` longer than
    :data:`MAX_FUNCTION_LINES` (decorators and docstring included) whose definition is not preceded by a comment
    saying why."""
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                length = node.end_lineno - first + 1
                if length > MAX_FUNCTION_LINES and not (first >= 2 and lines[first - 2].strip().startswith("#")):
                    found.append(f"{path}:{node.name} ({length} lines)")
    return found


def test_no_function_over_80_lines_without_a_reason():
    assert long_functions_without_a_reason(ROOT) == []


def test_the_length_check_can_fail(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n\n# a reason\ndef kept():\n{body}\n")
    assert long_functions_without_a_reason(tmp_path) == [f"{tmp_path / 'm.py'}:long (81 lines)"]
