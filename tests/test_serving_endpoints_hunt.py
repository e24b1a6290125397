"""The server's operational routes as vLLM users' tooling reads them: `/version`, `/v1/models` through the
`openai` client, the Prometheus text of `/metrics`, and the error answers of unknown routes and wrong methods."""

from __future__ import annotations

import re

import httpx
import pytest

import recurrent_depth as rd
from recurrent_depth.serving import build_app
from tests.test_serving import LiveServer, model_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("one_thread")

KEY = "sk-endpoints"


@pytest.fixture(scope="module")
def live(model_dir):  # noqa: F811
    with LiveServer(build_app(model_dir, model_name="tiny", api_key=KEY, tokenizer_workers=1)) as server:
        yield server


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {KEY}"}


def test_version_answers_as_vllms_and_needs_the_key(live):
    assert httpx.get(live.url + "/version", headers=auth()).json() == {"version": rd.__version__}
    refused = httpx.get(live.url + "/version")
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"


def test_a_wrong_method_is_a_json_405_naming_the_allowed_methods(live):
    for method, path, allowed in [("POST", "/v1/models", "GET"), ("GET", "/v1/completions", "POST"),
                                  ("DELETE", "/health", "GET")]:
        r = httpx.request(method, live.url + path, headers=auth())
        assert r.status_code == 405, (method, path)
        assert r.headers.get("allow") == allowed, (method, path, dict(r.headers))
        assert r.json()["error"]["message"] == f"{method} {path}: Method Not Allowed"
    missing = httpx.get(live.url + "/v2/nothing", headers=auth())
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_models_list_through_the_openai_client(live):
    models = live.client(api_key=KEY).models.list().data
    assert [(m.id, m.object, m.owned_by, m.parent, m.max_model_len) for m in models] == \
        [("tiny", "model", "recurrent-depth", None, 256)]


SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*"'
                    r'(,[a-zA-Z_][a-zA-Z0-9_]*="[^"\\\n]*")*\})? (\S+)$')


def test_metrics_are_valid_prometheus_text(live):
    """A strict reading of the text format 0.0.4: each sample belongs to a family TYPEd before it (histograms
    through _bucket/_sum/_count), counters end in _total, values are floats, buckets are cumulative."""
    done = httpx.post(live.url + "/v1/completions", headers=auth(), timeout=60,
                      json={"model": "tiny", "prompt": "hello", "max_tokens": 2})
    assert done.status_code == 200
    r = httpx.get(live.url + "/metrics", headers=auth())
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    types: dict[str, str] = {}
    helped: set[str] = set()
    buckets: dict[str, list[float]] = {}
    for line in r.text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            assert name not in types and kind in {"counter", "gauge", "histogram"}, line
            assert kind != "counter" or name.endswith("_total"), line
            types[name] = kind
            continue
        if line.startswith("# HELP "):
            helped.add(line.split(" ")[2])
            continue
        match = SAMPLE.match(line)
        assert match, line
        name, value = match.group(1), float(match.group(4))
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        assert types.get(name) in {"counter", "gauge"} or types.get(family) == "histogram", line
        if name.endswith("_bucket"):
            buckets.setdefault(family, []).append(value)
    assert types["rdepth_requests_total"] == "counter" and 'status="200"' in r.text
    assert set(types) <= helped, set(types) - helped  # every family says what it measures (the gauges did not)
    for family, counts in buckets.items():
        assert counts == sorted(counts), family
        assert f"{family}_count {int(counts[-1])}" in r.text, family
