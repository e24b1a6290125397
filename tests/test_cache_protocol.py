"""One cache protocol (issue 26.2): every method the runtime calls on a cache is named by `ModelCache` /
`StepCache` (model/cache.py), with no `getattr` probing, and every storage implements it."""

import ast
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import recurrent_depth
from recurrent_depth.inference.cache import DynamicRecurrentCache, StaticRecurrentCache
from recurrent_depth.integrations.hf import RecurrentDepthCache
from recurrent_depth.model.cache import DynamicCache, ModelCache, StepCache
from recurrent_depth.model.replay import ReplayKV
from recurrent_depth.serving.kv_pool import QuantizedSlotKVPool, SlotKVPool

PACKAGE = Path(recurrent_depth.__file__).parent
RUNTIME = ("model", "inference", "accel")  # the packages that run a model over a cache
SPEC = "k=prod:3.5,v=mse:3.5"


def members(protocol: type) -> set[str]:
    """The fields and methods a Protocol class names (its own and its Protocol bases')."""
    names = set()
    for cls in protocol.__mro__:
        if cls in (object,) or not getattr(cls, "_is_protocol", False):
            continue
        names |= set(vars(cls).get("__annotations__", {}))
        names |= {n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")}
    return names


def is_cache(node: ast.AST) -> bool:
    """`cache` or `<anything>.cache` (`ctx.cache`, `pass_.step.ctx.cache`); not `self.cache`, the concrete
    storage an owner built and typed itself (the session's)."""
    if isinstance(node, ast.Name):
        return node.id == "cache"
    return (isinstance(node, ast.Attribute) and node.attr == "cache"
            and not (isinstance(node.value, ast.Name) and node.value.id == "self"))


def runtime_cache_uses() -> tuple[dict[str, set[str]], list[str]]:
    """(attribute -> files using it on a cache, getattr / hasattr probes of a cache) in the runtime packages."""
    used: dict[str, set[str]] = {}
    probes = []
    for package in RUNTIME:
        for path in (PACKAGE / package).rglob("*.py"):
            where = str(path.relative_to(PACKAGE))
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Attribute) and is_cache(node.value):
                    used.setdefault(node.attr, set()).add(where)
                elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                      and node.func.id in ("getattr", "hasattr") and node.args and is_cache(node.args[0])):
                    probes.append(f"{where}:{node.lineno}")
    return used, probes


def test_every_method_the_runtime_calls_on_a_cache_is_in_the_protocol():
    used, probes = runtime_cache_uses()
    assert {"update_kv", "update_heads", "attend", "attends_from_codes", "close", "write_mask"} <= set(used)
    assert {name: sorted(files) for name, files in used.items() if name not in members(StepCache)} == {}
    assert probes == []  # no `getattr(cache, ...)`: what a cache offers is the protocol's


def storage_classes() -> set[str]:
    """Every class in the package that stores keys and values (defines or assigns `update_kv`), but the standalone
    remote-code file, which must load without the library."""
    remote = PACKAGE / "integrations" / "remote"
    return {
        node.name
        for path in PACKAGE.rglob("*.py") if remote not in path.parents
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.ClassDef) and not any(
            isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)
        and any(defines(item, "update_kv") for item in node.body)
    }


def defines(item: ast.stmt, name: str) -> bool:
    """A class-body statement that gives the class the method `name`: a `def`, or `name = function`."""
    if isinstance(item, ast.FunctionDef):
        return item.name == name
    return isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in item.targets)


def storages() -> dict[str, list]:
    """One instance of every storage, by the class that defines its `update_kv`; the generation caches
    with and without quantized entries."""
    return {
        "DynamicCache": [DynamicCache()],
        "StaticRecurrentCache": [StaticRecurrentCache(2, 3, capacity=4), StaticRecurrentCache(2, 3, kv_quant=SPEC)],
        "DynamicRecurrentCache": [DynamicRecurrentCache(2, 3), DynamicRecurrentCache(2, 3, kv_quant=SPEC)],
        "SlotKVPool": [SlotKVPool(), QuantizedSlotKVPool(SPEC)],
        "RecurrentDepthCache": [RecurrentDepthCache(1, 2, 1)],
        "ReplayKV": [ReplayKV(torch.ones(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))],
    }


def test_every_storage_implements_the_protocol():
    instances = storages()
    assert set(instances) == storage_classes()  # a new storage joins this test
    step_caches = ("StaticRecurrentCache", "DynamicRecurrentCache")  # the engine's per-token-depth storages
    missing = {
        type(cache).__name__: sorted(n for n in members(StepCache if name in step_caches else ModelCache)
                                     if not hasattr(cache, n))
        for name, group in instances.items() for cache in group
    }
    assert {k: v for k, v in missing.items() if v} == {}
    assert [c.attends_from_codes for c in instances["StaticRecurrentCache"]] == [False, True]
    assert [c.attends_from_codes for c in instances["SlotKVPool"]] == [False, True]
    assert not any(c.attends_from_codes for c in instances["DynamicRecurrentCache"])  # the round trip reads floats


def naive_attention(q, k, v, visible):
    """Softmax attention of q `[B, H, T, D]` over k, v `[B, Hkv, S, D]` where `visible` `[B, T, S]`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~visible[:, None], float("-inf")), dim=-1) @ v


@pytest.mark.parametrize("storage", ["static", "dynamic", "model"])
def test_a_float_storage_attends_as_plain_softmax_attention(storage):
    """`attend` of float storages (`attend_floats`): GQA, and the `skip` lookup's hidden columns."""
    torch.manual_seed(0)
    B, H, Hkv, D, T = 2, 4, 2, 8, 3
    if storage == "model":
        cache = DynamicCache()
    else:
        cls = StaticRecurrentCache if storage == "static" else DynamicRecurrentCache
        cache = cls(B, 2, policy="per-step+skip", **({"capacity": 4} if storage == "static" else {}))
    if storage != "model":  # a prompt whose second row's columns ran one step: hidden from step 1
        for step in range(2):
            cache.write_mask = torch.tensor([[True] * T, [step == 0] * T])
            cache.update_heads(("core", 0, step), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D))
        cache.write_mask = None
        cache.close(torch.tensor([[2] * T, [1] * T]))
    else:
        cache.update_kv(("core", 0, 1), torch.randn(B, T, Hkv, D), torch.randn(B, T, Hkv, D))
    cache.advance(T)
    q, k, v = torch.randn(B, H, 1, D), torch.randn(B, Hkv, 1, D), torch.randn(B, Hkv, 1, D)
    out = cache.attend(("core", 0, 1), q, k, v, None, False)  # one new query: it sees every column
    if storage == "model":  # the columns attended: what the cache now holds
        K, V = (x.transpose(1, 2) for x in cache.kv[("core", 0, 1)])
    else:  # the same write again returns the same columns
        K, V = cache.update_heads(("core", 0, 1), k, v)
    visible = torch.ones(B, 1, T + 1, dtype=torch.bool)
    if storage != "model":
        visible[1, :, :T] = False  # skip: row 1's prompt never reached step 1
    torch.testing.assert_close(out, naive_attention(q, K, V, visible))
    if storage == "model":
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, K, V, enable_gqa=True))
