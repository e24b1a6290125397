"""tokenizer_config.json's chat_template of a wrong type is named in one line (it was read as no template:
the server's chat went off and `rdepth sft` trained untemplated, without a word)."""

from __future__ import annotations

import json

import pytest

from recurrent_depth.serving.chat_template import load_template


def _dir(tmp_path, config):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(("config", "match"), [
    ({"chat_template": 5}, "chat_template must be a string"),
    ({"chat_template": {"default": "{{ x }}"}}, "chat_template must be a string"),
    ({"chat_template": [{"name": "tool_use", "template": "{{ x }}"}]}, "none 'default'"),
    ({"chat_template": [{"name": "default", "template": 7}]}, "chat_template must be a string"),
    (["not", "an", "object"], "must hold a JSON object"),
])
def test_a_wrongly_typed_template_is_named(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        load_template(_dir(tmp_path, config))


def test_valid_forms_still_load(tmp_path):
    assert load_template(_dir(tmp_path, {"chat_template": "{{ messages }}"}))[0] == "{{ messages }}"
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert load_template(_dir(tmp_path, {"chat_template": named}))[0] == "D"
    assert load_template(_dir(tmp_path, {"chat_template": ""}))[0] is None
    assert load_template(_dir(tmp_path, {"bos_token": "<s>"})) == (None, {"bos_token": "<s>"})
