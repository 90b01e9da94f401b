"""`response_format` through llama.cpp's grammar sampler: the tiny model's tokens are noise, so
every valid output below is the grammar's doing. A schema the converter cannot handle is a 400
naming the part."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from serve_support import is_idle, wait_idle

MODEL = "tiny-f32"
SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "colour": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer"},
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["ok", "colour", "size", "name"],
    "additionalProperties": False,
}


def test_every_json_schema_output_parses_and_validates_over_20_seeds(client, server):
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    finishes = set()
    for seed in range(20):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a ball"}],
            max_tokens=96, temperature=1.0, seed=seed, response_format=fmt)
        choice = r.choices[0]
        finishes.add(choice.finish_reason)
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert finishes == {"stop"}  # the grammar ends, then only the end token is allowed
    # The same through completions, streamed, with n = 2.
    stream = client.completions.create(model=MODEL, prompt="{", max_tokens=96, n=2, seed=3,
                                       stream=True, extra_body={"response_format": fmt})
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    for text in texts.values():
        jsonschema.validate(json.loads(text), SCHEMA)
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_json_object_mode_gives_a_json_object(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON please"}], max_tokens=200,
            temperature=0.7, seed=seed, response_format={"type": "json_object"},
            logit_bias={"34": 8})  # '"' is likelier: the object tends to close sooner
        choice = r.choices[0]
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:  # cut by max_tokens: still a prefix of an object
            assert choice.message.content.startswith("{")


@pytest.mark.parametrize("fmt, param", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"when": {"type": "timestamp"}}}}},
     "response_format.json_schema.schema.properties.when"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"code": {"type": "string", "pattern": "[a-z]+"}}}}},
     "response_format.json_schema.schema.properties.code"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "$ref": "https://example.com/schema.json"}}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}}},
     "response_format.json_schema.schema.properties.n.maximum"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "scheme": {}}},
     "response_format.json_schema.scheme"),
    ({"type": "regex"}, "response_format.type"),
])
def test_a_schema_the_converter_cannot_handle_is_a_400_naming_the_part(server, fmt, param):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
            "response_format": fmt}
    r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
    assert is_idle(wait_idle(server), server.host.n_seq_max)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "a", "max_tokens": 10}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_tokens": 8,
                              "temperature": 1, "seed": 3})])
@pytest.mark.parametrize("schema", [{"const": 1}, {"enum": ["x"]}])
def test_response_format_with_min_tokens_is_refused_and_the_server_lives(server, path, body,
                                                                        schema):
    """A grammar complete before min_tokens allows only the held end token: llama.cpp's grammar
    sampler would be made to accept a token it forbids, which aborted the process."""
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
    r = httpx.post(server.url + path, json={"model": MODEL, **body, "min_tokens": 5,
                                            "response_format": fmt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text
    r = httpx.post(server.url + path, json={"model": MODEL, **body, "response_format": fmt},
                   timeout=30)
    assert r.status_code == 200, r.text
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def _schema(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


@pytest.mark.parametrize("schema, param", [
    # One nested group a character to llama.cpp's parser: 30 000 overflowed its stack and
    # killed the server; 10^9 took the converter to gigabytes.
    ({"type": "string", "maxLength": 30000}, "maxLength"),
    ({"type": "string", "minLength": 1e9}, "minLength"),
    ({"type": "object", "properties": {"v": {"type": "array", "minItems": 1001,
                                             "items": {"type": "integer"}}}},
     "properties.v.minItems"),
    ({"type": "string", "pattern": "^a{0,5000}$"}, "pattern"),
    ({"$defs": {"d": {"type": "string", "pattern": "^(ab){2000}$"}}, "$ref": "#/$defs/d"},
     "$defs.d.pattern")])
def test_a_count_past_the_grammars_limit_is_a_400_and_the_server_lives(server, schema, param):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3, "response_format": _schema(schema)}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema." + param, err
    assert "at most 1000" in err["message"], err
    body["response_format"] = _schema({"type": "string", "maxLength": 1000})  # the limit
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert is_idle(wait_idle(server), server.host.n_seq_max)


def test_response_format_with_ignore_eos_is_refused(server):
    body = {"model": MODEL, "prompt": "x", "ignore_eos": True,
            "response_format": {"type": "json_object"}}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"


# The tiny model's byte tokens <0x00>..<0xFF> are ids 3..258: a bias toward the control
# characters, the quote and the backslash tries to put them into the strings.
_UNSAFE_BIAS = {str(3 + b): 30 for b in [*range(0x20), 0x22, 0x5C, 0x7F]}


def test_strings_under_a_schema_hold_nothing_json_must_escape(client):
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 3},
        "b": {"type": "string", "pattern": "^.{2}$"},
        "c": {"type": "string", "pattern": "^[^@]{1,3}$"},
        "d": {"type": "string", "pattern": "^[ -~]{2}$"}},
        "required": ["a", "b", "c", "d"], "additionalProperties": False}
    for seed in range(8):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=80,
            temperature=1.0, seed=seed, logit_bias=_UNSAFE_BIAS,
            response_format=_schema(schema))
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)


@pytest.mark.parametrize("pattern, what", [('^a"$', "'\"'"), ("^a\\\\$", "\\\\"),
                                           ("^a\\n$", "\\n"), ("^\\x1f$", "\\x1f"),
                                           ('^[[]"$', "'\"'")])
def test_a_pattern_that_matches_what_json_must_escape_is_a_400(server, pattern, what):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3,
            "response_format": _schema({"type": "string", "pattern": pattern})}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema.pattern", err
    assert f"matches {what}, a character the grammar would write" in err["message"], err
    # Inside a class they are only left out: the rest of the class stays.
    body["response_format"] = _schema({"type": "string", "pattern": '^[a"\\\\\\n]{2}$'})
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


# Byte tokens that spell code points no UTF-8 text holds: surrogates (ED A0..BF xx) and past
# U+10FFFF (F4 90.. and F5..F7 leads), which llama.cpp's grammar decodes as code points.
_INVALID_BIAS = {str(3 + b): 30 for b in [0xED, 0xF4, 0xF5, 0xF6, 0xF7, *range(0x90, 0xC0)]}


@pytest.mark.parametrize("fmt", ["json_object", "schema"])
def test_strings_under_a_grammar_are_valid_utf8(client, fmt):
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 4},
        "b": {"type": "string", "pattern": "^.{2}$"},
        "c": {"type": "string", "pattern": "^[^@]{1,3}$"}},
        "required": ["a", "b", "c"], "additionalProperties": False}
    response_format = {"type": "json_object"} if fmt == "json_object" else _schema(schema)
    for seed in range(8):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=80,
            temperature=1.0, seed=seed, logit_bias=_INVALID_BIAS,
            response_format=response_format)
        choice = r.choices[0]
        text = choice.message.content
        if choice.finish_reason == "length" and text.endswith("\ufffd"):
            text = text[:-1]  # cut inside its last character, which stays partial
        assert "\ufffd" not in text, (seed, choice.message.content)
        if choice.finish_reason == "stop":
            out = json.loads(choice.message.content)
            if fmt == "schema":
                jsonschema.validate(out, schema)


# ECMA-262's `\s` (JSON Schema's regular expressions), for Python's `re` with re.ASCII.
_WS = r" \t\n\r\x0B\x0C\u00A0\u1680\u2000-\u200A\u2028\u2029\u202F\u205F\u3000\uFEFF"


def _ecma(pattern: str) -> str:
    return pattern.replace(r"\s", f"[{_WS}]").replace(r"\S", f"[^{_WS}]")


def test_class_escapes_in_a_pattern_are_enforced(client):
    patterns = {"a": r"^\d{3}$", "b": r"^\w{2,4}$", "c": r"^[\d.-]{1,5}$", "d": r"^\D\S\W$",
                "e": r"^x\s?y$", "f": r"^[^\d]{2}[\D]$"}
    schema = {"type": "object",
              "properties": {k: {"type": "string", "pattern": p} for k, p in patterns.items()},
              "required": sorted(patterns), "additionalProperties": False}
    for seed in range(8):
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "json"}], max_tokens=120,
            temperature=1.0, seed=seed, response_format=_schema(schema))
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        out = json.loads(choice.message.content)
        for key, pattern in patterns.items():
            assert re.fullmatch(_ecma(pattern.strip("^$")), out[key], re.ASCII), (key, out)


def test_a_negated_class_escape_beside_other_characters_is_a_400(server):
    body = {"model": MODEL, "prompt": "a", "max_tokens": 3, "response_format": _schema(
        {"type": "object", "properties": {"p": {"type": "string", "pattern": r"^[a\D]$"}}})}
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format.json_schema.schema.properties.p", err
    assert "\\D stands in a character class beside other characters" in err["message"], err
    assert is_idle(wait_idle(server), server.host.n_seq_max)
