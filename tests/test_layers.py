"""Imports go strictly from higher layers to lower ones, as docs/architecture.md states.

Every ``import`` of a ``bubblefree`` module is read with ``ast``, including the imports inside functions (a
deferred import is still a dependency), and checked against the layer list below, which is the order of
docs/architecture.md. Inside a package, modules may import each other as long as no import circle forms.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "bubblefree"

LAYERS: list[tuple[str, ...]] = [
    ("bubblefree", "bubblefree.errors", "bubblefree.interrupts", "bubblefree.schedules.table"),
    ("bubblefree.sections",),
    ("bubblefree.config",),
    ("bubblefree.optim", "bubblefree.models", "bubblefree.data", "bubblefree.schedules"),
    ("bubblefree.delay",),
    ("bubblefree.train",),
    ("bubblefree.distributed",),
    ("bubblefree.experiments", "bubblefree.export"),
    ("bubblefree.bench",),
    ("bubblefree.commandline",),
    ("bubblefree.cli", "bubblefree.docs"),
    ("bubblefree.__main__", "bubblefree.distributed.__main__"),
]
"""Lowest first. A module belongs to the longest entry that names it or a package above it (the root package
``bubblefree``, which only holds the version, names itself alone)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The bubblefree modules ``path`` imports (``from a import b`` counts as ``a.b`` when that is a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
            names |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES}
    return {n for n in names if n.split(".")[0] == "bubblefree" and n in MODULES}


MODULES = {_module_name(p): p for p in SRC.rglob("*.py")}
GRAPH = {name: _imports(path) - {name} for name, path in MODULES.items()}


def layer_of(module: str) -> tuple[int, str]:
    """``(layer index, the entry of LAYERS that holds module)``."""
    owners = [(len(entry), i, entry) for i, layer in enumerate(LAYERS) for entry in layer
              if module == entry or (entry != "bubblefree" and module.startswith(entry + "."))]
    assert owners, f"{module} is in no layer: add it to LAYERS and to docs/architecture.md"
    _, index, entry = max(owners)
    return index, entry


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_go_from_high_to_low(module):
    mine, my_entry = layer_of(module)
    for target in sorted(GRAPH[module]):
        theirs, their_entry = layer_of(target)
        assert theirs < mine or their_entry == my_entry, (
            f"{module} (layer {mine}, {my_entry}) imports {target} (layer {theirs}, {their_entry})")


def test_no_import_circles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                # A package's __init__ re-exporting its own modules is not a circle through the package.
                if not nxt.startswith(node + ".") and not node.startswith(nxt + "."):
                    raise AssertionError("import circle: " + " -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_the_config_module_is_a_leaf():
    assert GRAPH["bubblefree.config"] <= {"bubblefree.errors", "bubblefree.sections", "bubblefree.schedules.table"}
    assert GRAPH["bubblefree.sections"] <= {"bubblefree.schedules.table"}
    assert GRAPH["bubblefree.schedules.table"] == GRAPH["bubblefree.errors"] == set()


def test_the_config_loads_no_torch_and_nothing_above_it():
    """Importing the schedule table runs the ``schedules`` package first, which the imports read above do not
    see: the config must still load without torch and without a module of a higher layer (nor a cycle)."""
    code = ("import sys, bubblefree.config; print('torch' in sys.modules); "
            "print(' '.join(sorted(m for m in sys.modules if m.startswith('bubblefree'))))")
    torch, loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                   check=True).stdout.splitlines()
    assert torch == "False"
    assert set(loaded.split()) <= {"bubblefree", "bubblefree.errors", "bubblefree.config", "bubblefree.sections",
                                   "bubblefree.schedules", "bubblefree.schedules.table",
                                   "bubblefree.schedules.delays"}


def test_architecture_doc_states_the_same_order():
    text = (ROOT / "docs" / "architecture.md").read_text()
    line = re.search(r"<!-- layers -->\n(.+?)\n", text).group(1)
    stated = [tuple(sorted(re.findall(r"`([\w.]+)`", part))) for part in line.split("->")]
    expected = [tuple(sorted(e.removeprefix("bubblefree.") or "bubblefree" for e in layer)) for layer in LAYERS]
    assert stated == expected


def test_functions_read_in_one_screen_and_files_stay_short():
    """No function of the package over 80 lines, no module over 500 (issue 45: a longer one is split into
    parts whose names explain them)."""
    long = []
    for name, path in MODULES.items():
        text = path.read_text()
        if text.count("\n") > 500:
            long.append(f"{name}: {text.count(chr(10))} lines")
        long += [f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines" for node in ast.walk(ast.parse(text))
                 if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []
