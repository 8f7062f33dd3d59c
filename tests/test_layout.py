"""The layout is the architecture: one folder per layer, imports only downwards, no circle,
short modules, and an analysis layer that never loads torch, a model or an engine."""

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mgbench"

# From the top of the data flow down; a module may import its own layer or any layer below.
LAYERS = ["cli", "pipelines", "engines", "render", "analysis", "runs", "assets"]
BASE = {"mgbench", "mgbench.errors"}  # the version and the one error type: importable from anywhere
FLAT_ALLOWED = {"__init__.py", "__main__.py", "errors.py"}
# Engines are siblings: each one stands alone on the shared interface.
ENGINE_FOLDERS = {"mgbench.engines.inprocess", "mgbench.engines.endpoint"}
MAX_LINES = 400


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(path: Path, modules: dict[str, Path]) -> set[str]:
    """Every mgbench module this file imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("mgbench")}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import (the layout uses absolute imports)"
            if node.module and node.module.startswith("mgbench"):
                for alias in node.names:  # `from mgbench.runs import schema` imports a module
                    sub = f"{node.module}.{alias.name}"
                    found.add(sub if sub in modules else node.module)
    return found & set(modules)


def layer_of(module: str) -> int:
    if module == "mgbench.__main__":  # `python -m mgbench`: above the CLI it runs
        return -1
    parts = module.split(".")
    assert len(parts) > 1 and parts[1] in LAYERS, f"{module} is in no layer"
    return LAYERS.index(parts[1])


def engine_folder(module: str) -> str | None:
    return next((folder for folder in ENGINE_FOLDERS if module == folder or module.startswith(folder + ".")), None)


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: imported_modules(path, modules) - {name} for name, path in modules.items()}


def test_no_flat_module_beside_the_layer_folders():
    flat = {path.name for path in PACKAGE.glob("*.py")}
    assert flat <= FLAT_ALLOWED, sorted(flat - FLAT_ALLOWED)
    folders = {path.name for path in PACKAGE.iterdir() if path.is_dir() and path.name != "__pycache__"}
    assert folders == set(LAYERS), folders


def wrong_edges(graph: dict[str, set[str]]) -> list[str]:
    """Imports that run up the layers, or from one engine's folder into another's."""
    wrong = []
    for module, targets in graph.items():
        if module in BASE:
            continue
        for target in targets - BASE:
            mine, theirs = engine_folder(module), engine_folder(target)
            if layer_of(target) < layer_of(module) or (mine and theirs and mine != theirs):
                wrong.append(f"{module} -> {target}")
    return wrong


def import_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of imports (a list of modules, first == last), or None."""
    state: dict[str, str] = {}

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return path[path.index(target) :] + [target]
            if target not in state:
                found = visit(target, path + [target])
                if found:
                    return found
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state:
            found = visit(module, [module])
            if found:
                return found
    return None


def test_every_import_points_down_the_layers():
    assert wrong_edges(import_graph()) == []


# Inside the in-process engine, from the top down: the engine, its audit, verification (how a policy
# decides and repairs), the runners (solo and teacher-forced loops), the kernel sets (how a kernel
# is made invariant), then the flat base modules (cache, decode, metrics, timing).
INPROCESS = ["engine", "audit", "verification", "runners", "kernels"]


def inprocess_level(module: str) -> int | None:
    prefix = "mgbench.engines.inprocess."
    if not module.startswith(prefix):
        return None
    part = module[len(prefix) :].split(".")[0]
    return INPROCESS.index(part) if part in INPROCESS else len(INPROCESS)


def wrong_inprocess_edges(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for module, targets in graph.items():
        mine = inprocess_level(module)
        for target in targets:
            theirs = inprocess_level(target)
            if mine is not None and theirs is not None and theirs < mine:
                wrong.append(f"{module} -> {target}")
    return wrong


def test_the_inprocess_engine_imports_point_down_its_folders():
    assert wrong_inprocess_edges(import_graph()) == []
    planted = {  # negative control: a kernel module reaching up into verification and the runners
        "mgbench.engines.inprocess.kernels.fixed_order": {
            "mgbench.engines.inprocess.verification.spec",
            "mgbench.engines.inprocess.runners",
            "mgbench.engines.inprocess.cache",
        },
        "mgbench.engines.inprocess.verification.loop": {"mgbench.engines.inprocess.kernels.sets"},
    }
    assert sorted(wrong_inprocess_edges(planted)) == [
        "mgbench.engines.inprocess.kernels.fixed_order -> mgbench.engines.inprocess.runners",
        "mgbench.engines.inprocess.kernels.fixed_order -> mgbench.engines.inprocess.verification.spec",
    ]


def test_no_import_circle():
    assert import_circle(import_graph()) is None


def test_the_checks_catch_a_planted_upward_import_and_circle():
    # Negative controls of the checks themselves, on planted graphs.
    planted = {
        "mgbench.analysis.figures": {"mgbench.engines.inprocess.runners", "mgbench.runs.schema"},
        "mgbench.engines.endpoint.audit": {"mgbench.engines.inprocess.cache", "mgbench.engines.interface"},
        "mgbench.cli.flips": {"mgbench.pipelines.flips", "mgbench.errors"},
    }
    assert sorted(wrong_edges(planted)) == [
        "mgbench.analysis.figures -> mgbench.engines.inprocess.runners",
        "mgbench.engines.endpoint.audit -> mgbench.engines.inprocess.cache",
    ]
    circle = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_circle(circle) == ["a", "b", "c", "a"]
    assert import_circle({"a": {"b"}, "b": set()}) is None


def test_no_module_over_the_line_limit():
    long = {name: len(path.read_text().splitlines()) for name, path in all_modules().items()}
    assert all(lines <= MAX_LINES for lines in long.values()), {n: k for n, k in long.items() if k > MAX_LINES}


def test_analysis_loads_no_torch_model_or_engine():
    # A fresh interpreter: the suite's own imports must not hide a torch import.
    code = (
        "import importlib, pkgutil, sys, mgbench.analysis as a\n"
        "for m in pkgutil.iter_modules(a.__path__): importlib.import_module('mgbench.analysis.' + m.name)\n"
        "banned = ('torch', 'transformers', 'mgbench.engines', 'mgbench.assets.models', 'mgbench.pipelines')\n"
        "print(sorted(k for k in sys.modules if k.startswith(banned)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


HELP_AND_EARLY_ERRORS = """
import contextlib, io, json, sys
from typer.main import get_command
from mgbench.cli import app

HEAVY = ("torch", "transformers")
commands = sorted(get_command(app).commands)
# --help of the app and of every command; then input errors the run options refuse, per command.
calls = [[], *([name] for name in commands)]
calls = [[*call, "--help"] for call in calls]
calls += [[name, "--batch-size", "0"] for name in ("flips", "compare", "calibrate")]
calls += [["verify", "--batch-sizes", "0"], ["probe", "--device", "tpu"]]
seen = []
for call in calls:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            app(call, prog_name="mgbench")
            code = 0
        except SystemExit as exit:
            code = exit.code
    heavy = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
    seen.append({"call": call, "code": code, "usage": "Usage" in out.getvalue(), "heavy": heavy[:5]})
print(json.dumps({"commands": commands, "seen": seen}))
"""


def test_help_and_early_input_errors_load_no_torch():
    # A fresh interpreter: the suite's own imports must not hide a torch import. Modules are read
    # after each call, so the first call that imports torch or transformers is the one named.
    out = subprocess.run(
        [sys.executable, "-c", HELP_AND_EARLY_ERRORS], capture_output=True, text=True, check=True, timeout=120
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    expected = {"flips", "calibrate", "verify", "compare", "probe", "diff", "report", "models", "datasets"}
    assert set(report["commands"]) >= expected
    helps = [s for s in report["seen"] if s["call"][-1] == "--help"]
    assert len(helps) == len(report["commands"]) + 1
    assert all(s["code"] == 0 and s["usage"] for s in helps), helps
    assert all(s["code"] == 2 for s in report["seen"] if s["call"][-1] != "--help"), report["seen"]
    assert [s for s in report["seen"] if s["heavy"]] == []
