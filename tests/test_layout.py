"""The package's shape: layers import only downward, no import cycles (function-local imports included), every
public subpackage reachable after ``import vitkit``, and function-local imports only with a reason."""
import ast
import subprocess
import sys
from pathlib import Path

import vitkit

SRC = Path(vitkit.__file__).parent
# Lowest first. A module may import from its own layer or a lower one. The top-level modules (vitkit/__init__,
# __main__) are facades over the layers and stand outside them.
LAYERS = [{"model"}, {"runtime", "interop"}, {"data"}, {"training"}, {"inspect", "serving"}, {"bench"},
          {"cli", "reproduce"}]  # reproduce plans and trains runs itself, as the CLI does
RANK = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def imports(name: str, text: str) -> list[tuple[str, int]]:
    """(vitkit module imported, line) for every import in module ``name`` (source ``text``), at any depth."""
    package = name if MODULES.get(name, Path()).name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(text)):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                base = ".".join(up[: len(up) - node.level + 1] + ([node.module] if node.module else []))
            # `from pkg import submodule` imports the submodule too
            targets = [base] + [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in MODULES]
        found += [(t, node.lineno) for t in targets if t.split(".")[0] == "vitkit" and t in MODULES]
    return found


def layer_of(module: str) -> int | None:
    parts = module.split(".")
    return RANK.get(parts[1]) if len(parts) > 1 else None


def upward_imports(sources: dict[str, str]) -> list[str]:
    found = []
    for name, text in sources.items():
        for target, line in imports(name, text):
            mine, theirs = layer_of(name), layer_of(target)
            if mine is not None and theirs is not None and theirs > mine:
                found.append(f"{name}:{line} -> {target}")
    return found


def find_cycle(sources: dict[str, str]) -> list[str] | None:
    # a module's own packages are imported before it anyway: `from . import sibling` is no edge back to them
    graph = {name: sorted(t for t, _ in imports(name, text) if not (name + ".").startswith(t + "."))
             for name, text in sources.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in graph.get(n, ()):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (cycle := visit(m)):
                return cycle
        stack.pop()
        state[n] = 2
        return None

    return next((c for n in sorted(graph) if n not in state and (c := visit(n))), None)


SOURCES = {name: path.read_text() for name, path in MODULES.items()}


def test_every_subpackage_is_in_a_layer():
    pkgs = {p.parent.name for p in SRC.glob("*/__init__.py")}
    assert pkgs == set(RANK), "a new subpackage needs a place in LAYERS"


def test_no_module_imports_from_a_higher_layer():
    assert not upward_imports(SOURCES), "imports from a higher layer:\n" + "\n".join(upward_imports(SOURCES))


def test_no_import_cycles():
    cycle = find_cycle(SOURCES)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_checks_catch_an_upward_import_and_a_cycle():
    bad = dict(SOURCES)
    bad["vitkit.model.vit"] += "\n\ndef f():\n    from ..training import trainer  # hidden in a function\n"
    assert upward_imports(bad) == [f"vitkit.model.vit:{bad['vitkit.model.vit'].count(chr(10))} -> vitkit.training",
                                   f"vitkit.model.vit:{bad['vitkit.model.vit'].count(chr(10))} -> "
                                   "vitkit.training.trainer"]
    assert find_cycle(bad) is not None
    cyc = dict(SOURCES)
    cyc["vitkit.model.config"] += "\nfrom .vit import Attention\n"  # vit imports config
    assert find_cycle(cyc) is not None


def test_function_local_imports_say_why():
    """Outside the CLI (whose commands import the library when they run, so that `vitkit -h` stays quick), an import
    inside a function is there for an optional dependency or start-up time, and its line says which."""
    silent = []
    for name, path in MODULES.items():
        if ".cli." in name + ".":
            continue
        lines = path.read_text().splitlines()
        tree = ast.parse(path.read_text())
        for f in ast.walk(tree):
            if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for node in ast.walk(f):
                    if isinstance(node, (ast.Import, ast.ImportFrom)) and "#" not in lines[node.lineno - 1]:
                        silent.append(f"{path.relative_to(SRC)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    assert not silent, "function-local imports without a reason:\n" + "\n".join(sorted(set(silent)))


def test_subpackages_are_attributes_of_vitkit_and_import_lazily():
    code = ("import sys, vitkit\n"
            "eager = sorted(m for m in ('vitkit.interop', 'vitkit.training', 'vitkit.serving', 'vitkit.bench') "
            "if m in sys.modules)\n"
            "assert not eager, eager\n"
            "assert callable(vitkit.interop.from_timm) and callable(vitkit.inspect.attention_rollout)\n"
            "assert callable(vitkit.runtime.optimize_for_inference) and vitkit.training.Trainer\n"
            "assert vitkit.load is vitkit.interop.load and vitkit.optimize_for_inference\n"
            "for name in ('data', 'model', 'serving', 'bench', 'cli', 'reproduce'):\n"
            "    getattr(vitkit, name)\n"
            "try:\n    vitkit.no_such_thing\nexcept AttributeError as e:\n    assert 'no_such_thing' in str(e)\n"
            "else:\n    raise SystemExit('no AttributeError')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


