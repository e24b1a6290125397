"""The package's shape: layers point one way, and one public name means one thing."""

import ast
import collections
import functools
import importlib
import inspect
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import recurrent_depth

PACKAGE = Path(recurrent_depth.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every `recurrent_depth...` module a file imports, at top level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return {n for n in names if n.startswith("recurrent_depth")}


def test_model_imports_nothing_from_the_layers_above_it():
    above = ("train", "inference", "serving", "accel", "evaluation", "analysis", "integrations", "cli")
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(m for m in imported_modules(path)
                                               if m.split(".")[1:2] and m.split(".")[1] in above)
        for path in (PACKAGE / "model").rglob("*.py")
    }
    assert {k: v for k, v in offenders.items() if v} == {}


def test_one_training_loop():
    """Only the `Trainer` runs backward passes: recipes and experiments configure it (issue 18: one trainer)."""
    callers = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "backward"
    }
    assert callers == {"train/trainer.py"}


# Names defined in several modules on purpose: each decoding mode's module has its `decode`, and
# each experiment its `plot`; they are reached through their module, never imported bare.
SHARED_BY_DESIGN = {"decode", "plot"}


def test_a_public_class_or_function_name_means_one_thing():
    """`TextCodec`, `evaluate_depths` and `write_report` each named two different things once."""
    defined = collections.defaultdict(set)
    for info in pkgutil.walk_packages(recurrent_depth.__path__, "recurrent_depth."):
        if ".cli" in info.name or ".remote" in info.name:
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if obj.__module__ == module.__name__:
                defined[name].add(module.__name__)
    clashes = {name: sorted(mods) for name, mods in defined.items() if len(mods) > 1}
    assert set(clashes) - SHARED_BY_DESIGN == set(), clashes


# ---------------------------------------------------------------------------- the import graph
REMOTE = PACKAGE / "integrations" / "remote"  # the standalone remote-code file imports nothing of ours


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache  # (parsed once for the tests below; they only read it)
def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (top level, inside functions, under TYPE_CHECKING: all of
    them). `from a.b import c` is an edge to `a.b.c` when c is a module, else to `a.b`; relative imports resolve."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py") if REMOTE not in p.parents}
    # the standalone remote-code file is a leaf (it imports nothing of ours): an import of it is an edge to it,
    # not to the integrations package above it
    leaves = {module_name(p) for p in REMOTE.rglob("*.py") if p.name != "__init__.py"}
    graph: dict[str, set[str]] = {leaf: set() for leaf in leaves}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files and target not in leaves:  # `import a.b.c` of a name in a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_the_import_graph_finds_circles():
    """The checker itself: a circle of three, a self-standing module and a tail into the circle."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_circles(graph) == [["a", "b", "c"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_in_the_package():
    """Every module's imports, lazy ones included, form no circle (issue 26: layers point one way)."""
    graph = import_graph()
    # the root's import hook (integrations/autoregister.py) applies accel from outside
    assert "recurrent_depth.accel.runner" in graph["recurrent_depth.integrations.autoregister"]
    assert import_circles(graph) == []


def test_inference_and_model_import_nothing_from_accel():
    """Hardware tuning is applied from outside: `make_runner` is handed the fast runner (`register_fast_runner`)."""
    offenders = {
        name: sorted(t for t in targets if t.startswith("recurrent_depth.accel"))
        for name, targets in import_graph().items()
        if name.startswith(("recurrent_depth.inference", "recurrent_depth.model"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}


@pytest.mark.parametrize("first", ["recurrent_depth.accel.runner", "recurrent_depth.inference"])
def test_the_fast_runner_is_registered_whichever_module_is_imported_first(first):
    """`accel.runner` imports `inference.runner` midway; imported first, it still ends registered (once),
    with no warning from the import hook."""
    code = (f"import warnings; warnings.simplefilter('error'); import {first}; import recurrent_depth as rd; "
            "from recurrent_depth.inference import runner; from recurrent_depth.accel.runner import fast_runner; "
            "assert runner._FAST_RUNNERS == [fast_runner], runner._FAST_RUNNERS")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_make_runner_asks_the_registered_factories_in_order(monkeypatch):
    """A factory that declines (None) passes the model on; `fast=False` asks none; none left: the reference."""
    import torch

    from recurrent_depth.accel.runner import FastRunner, fast_runner
    from recurrent_depth.inference import runner as runner_module

    model = recurrent_depth.RecurrentDepthLM(recurrent_depth.ModelConfig.from_preset("tiny")).eval()
    asked = []
    monkeypatch.setattr(runner_module, "_FAST_RUNNERS", [])
    runner_module.register_fast_runner(lambda m: asked.append("declines"))
    runner_module.register_fast_runner(fast_runner)
    runner_module.register_fast_runner(fast_runner)  # once only
    assert isinstance(runner_module.make_runner(model), FastRunner) and asked == ["declines"]
    assert type(runner_module.make_runner(model, fast=False)) is runner_module.ModelRunner and asked == ["declines"]
    monkeypatch.setattr(runner_module, "_FAST_RUNNERS", [])
    assert type(runner_module.make_runner(model)) is runner_module.ModelRunner
    assert torch.is_grad_enabled()  # the fast runner was built under no_grad, which ends with it
