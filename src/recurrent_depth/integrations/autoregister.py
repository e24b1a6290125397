"""Register with transformers / lm-eval when (and only when) those libraries load.

Importing transformers' model machinery takes seconds, so `import recurrent_depth` must not do it.
Instead a small `sys.meta_path` finder watches for a few module names and, right after such a
module has executed, runs our registration. Nothing else about the import changes: the real
finder still locates the module and the real loader still executes it.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any

CONFIG_AUTO = "transformers.models.auto.configuration_auto"
MODELING_AUTO = "transformers.models.auto.modeling_auto"
LM_EVAL_MODELS = "lm_eval.models"
PEFT_CONSTANTS = "peft.utils.constants"  # peft's default-target tables, read when a config lacks target_modules
INFERENCE_RUNNER = "recurrent_depth.inference.runner"
LM_EVAL_BACKEND_NAME = "recurrent-depth"
LM_EVAL_BACKEND_TARGET = "recurrent_depth.evaluation.lm_eval_backend:RecurrentDepthEvalLM"

_lock = threading.RLock()
_done: set[str] = set()


def _register_configs(_: ModuleType | None = None) -> None:
    from recurrent_depth.integrations.hf_config import register_configs

    register_configs()


def _register_models(_: ModuleType | None = None) -> None:
    _register_configs()
    from recurrent_depth.integrations.hf import register_models
    from recurrent_depth.integrations.hf_seq_cls import register_sequence_classification

    register_models()
    register_sequence_classification()


def _register_lm_eval(_: ModuleType | None = None) -> None:
    from lm_eval.api.registry import model_registry

    if LM_EVAL_BACKEND_NAME not in model_registry:
        model_registry.register(LM_EVAL_BACKEND_NAME, target=LM_EVAL_BACKEND_TARGET)


def _register_peft(module: ModuleType | None = None) -> None:
    from recurrent_depth.integrations.hf_peft import register_peft

    register_peft(module)


def _register_fast_runner(_: ModuleType | None = None) -> None:
    """The fused runner of `accel` offered to `inference.runner` (which imports nothing from accel):
    `accel.runner` registers it as its import ends. When `accel.runner` is imported first, it imports
    `inference.runner` midway (this hook then finds it partly executed, and leaves the registration
    to its end)."""
    importing = sys.modules.get("recurrent_depth.accel.runner")
    if importing is not None and not hasattr(importing, "fast_runner"):
        return
    import recurrent_depth.accel.runner  # noqa: F401  (registers `fast_runner`)


_HOOKS: dict[str, Callable[[ModuleType | None], None]] = {
    INFERENCE_RUNNER: _register_fast_runner,
    CONFIG_AUTO: _register_configs,
    MODELING_AUTO: _register_models,
    LM_EVAL_MODELS: _register_lm_eval,
    PEFT_CONSTANTS: _register_peft,
}


def _run_hook(name: str, module: ModuleType | None) -> None:
    with _lock:
        if name in _done:
            return
        _done.add(name)
    try:
        _HOOKS[name](module)
    except Exception as exc:  # a failed registration must never break the user's import
        with _lock:
            _done.discard(name)
        again = ("recurrent_depth.integrations.hf_peft.register_peft()" if name == PEFT_CONSTANTS
                 else "recurrent_depth.integrations.register_transformers()")
        warnings.warn(
            f"recurrent_depth could not register with {name.split('.')[0]} ({type(exc).__name__}: {exc}); "
            f"call {again} to see the full error",
            RuntimeWarning,
            stacklevel=2,
        )


class _HookedLoader(importlib.abc.Loader):
    """Delegates to the real loader, then runs the registration for this module."""

    def __init__(self, loader: importlib.abc.Loader, name: str) -> None:
        self._loader = loader
        self._name = name

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        _run_hook(self._name, module)

    def __getattr__(self, attr: str) -> Any:  # get_source, get_filename, is_package, ...
        return getattr(self._loader, attr)


class _PostImportFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None):
        if fullname not in _HOOKS or fullname in _done:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _HookedLoader(spec.loader, fullname)
                return spec
        return None


_finder = _PostImportFinder()


def install_import_hooks() -> None:
    """Register now with whatever is already imported; register the rest when it gets imported."""
    with _lock:
        if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _finder)
    for name in _HOOKS:
        if name in sys.modules:
            _run_hook(name, sys.modules[name])


def register_transformers() -> None:
    """Register our configs and models with transformers' Auto classes now (imports transformers).

    Errors propagate, unlike the import hooks, which only warn.
    """
    _register_models()
    with _lock:
        _done.update({CONFIG_AUTO, MODELING_AUTO})
