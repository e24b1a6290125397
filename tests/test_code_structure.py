"""The package's shape: layers point one way, and one public name means one thing."""

import ast
import collections
import importlib
import inspect
import pkgutil
from pathlib import Path

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
