"""The request fields that ask for structured output map to one `StructuredOutputsParams`;
conflicts, bad shapes and grammars llguidance refuses are a 400 naming the field.

The mapping is checked on the request models directly; a few cases go through the shared server
to see the 400 arrive before anything is queued (no generation happens for them).
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from inferengine.entrypoints.batch.mapping import CHAT_URL, COMPLETIONS_URL, _openai_body
from inferengine.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
)
from inferengine.entrypoints.openai.serving_engine import OpenAIServing
from inferengine.entrypoints.openai.structured_outputs import structured_outputs
from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import RequestOutputKind, StructuredOutputsParams
from tests.entrypoints.openai.server import SERVED_NAME

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "required": ["a"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "hi"}]


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hello", **fields})


def json_schema(schema=SCHEMA, **spec) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, **spec}}


# ---- the mapping -----------------------------------------------------------------------------


@pytest.mark.parametrize("make", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"response_format": None}, None),
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        ({"response_format": json_schema()}, StructuredOutputsParams(json=SCHEMA)),
        (
            {"response_format": json_schema(strict=True, description="the reply")},
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"response_format": json_schema(strict=False)}, StructuredOutputsParams(json=SCHEMA)),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA)),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutputsParams(regex="[a-z]+")),
        (
            {"structured_outputs": {"choice": ["yes", "no"]}},
            StructuredOutputsParams(choice=["yes", "no"]),
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
            StructuredOutputsParams(grammar='root ::= "a" | "b"'),
        ),
        (
            {"structured_outputs": {"grammar": 'start: "a" | "b"'}},
            StructuredOutputsParams(grammar='start: "a" | "b"'),
        ),
        (
            {"structured_outputs": {"json_object": True}},
            StructuredOutputsParams(json_object=True),
        ),
        (  # vLLM's other keys, sent with values that ask for nothing
            {
                "structured_outputs": {
                    "regex": "[0-9]+",
                    "json": None,
                    "json_object": False,
                    "disable_any_whitespace": True,
                    "disable_additional_properties": False,
                    "whitespace_pattern": None,
                }
            },
            StructuredOutputsParams(regex="[0-9]+"),
        ),
        ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
        ({"guided_regex": "[ab]+"}, StructuredOutputsParams(regex="[ab]+")),
        ({"guided_choice": ["x", "y"]}, StructuredOutputsParams(choice=["x", "y"])),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"')),
        (
            {"guided_regex": "[ab]+", "guided_decoding_backend": "guidance"},
            StructuredOutputsParams(regex="[ab]+"),
        ),
        ({"guided_decoding_backend": "auto"}, None),
        # response_format text asks for nothing, so it does not conflict
        (
            {"response_format": {"type": "text"}, "guided_choice": ["x"]},
            StructuredOutputsParams(choice=["x"]),
        ),
    ],
)
def test_field_maps_to_params(make, fields, expected):
    assert structured_outputs(make(**fields)) == expected


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        # two fields at once: the second is named, the message names both
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "response_format and guided_regex",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA},
            "guided_json",
            "structured_outputs and guided_json",
        ),
        (
            {"response_format": json_schema(), "structured_outputs": {"choice": ["a"]}},
            "structured_outputs",
            "response_format and structured_outputs",
        ),
        (
            {"guided_choice": ["a"], "guided_grammar": 'root ::= "a"'},
            "guided_grammar",
            "guided_choice and guided_grammar",
        ),
        # two kinds inside structured_outputs
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "regex, choice",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "got none"),
        # response_format shapes
        ({"response_format": {"type": "xml"}}, "response_format.type", "'xml'"),
        ({"response_format": {}}, "response_format.type", "None"),
        (
            {"response_format": {"type": "structural_tag", "structures": []}},
            "response_format.type",
            "structural_tag",
        ),
        (
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "json_schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            "response_format.json_schema.name",
            "name is required",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
            "response_format.json_schema.schema",
            "schema is required",
        ),
        (
            {"response_format": json_schema(schema="not a schema")},
            "response_format.json_schema.schema",
            "JSON object",
        ),
        (
            {"response_format": json_schema(strict="yes")},
            "response_format.json_schema.strict",
            "boolean",
        ),
        # structured_outputs keys
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": False}},
            "structured_outputs.disable_any_whitespace",
            "without whitespace",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "whitespace_pattern": r"[ ]?"}},
            "structured_outputs.whitespace_pattern",
            "is not supported",
        ),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
            "structured_outputs.disable_additional_properties",
            "is not supported",
        ),
        (
            {"structured_outputs": {"structural_tag": "{}"}},
            "structured_outputs.structural_tag",
            "is not supported",
        ),
        (
            {"structured_outputs": {"jsonschema": SCHEMA}},
            "structured_outputs.jsonschema",
            "not a structured output key",
        ),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex", "wrong type"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice", "non-empty"),
        # guided_* shapes
        ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ({"guided_json": "[1, 2]"}, "guided_json", "JSON object"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        (
            {"guided_regex": "a", "guided_decoding_backend": "xgrammar"},
            "guided_decoding_backend",
            "llguidance",
        ),
        # grammars llguidance refuses
        ({"guided_regex": "[a-z"}, "guided_regex", "regex"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "regex"),
        ({"guided_grammar": 'root ::= "a'}, "guided_grammar", "grammar"),
        ({"structured_outputs": {"grammar": "start: x"}}, "structured_outputs.grammar", "x"),
        (
            {"response_format": json_schema(schema={"type": "foo"})},
            "response_format.json_schema.schema",
            "foo",
        ),
        ({"guided_json": {"type": "object", "minProperties": "two"}}, "guided_json", "json"),
    ],
)
def test_bad_request_names_the_field(fields, param, says):
    with pytest.raises(InvalidRequestError) as info:
        structured_outputs(chat(**fields))
    assert info.value.param == param
    assert says in info.value.message, info.value.message


def test_every_generating_request_takes_the_fields():
    for model in (ChatCompletionRequest, CompletionRequest, GenerateRequest):
        for name in ("response_format", "structured_outputs", "guided_json", "guided_choice"):
            assert name in model.model_fields, (model.__name__, name)
    req = GenerateRequest.model_validate({"prompt": "x", "guided_regex": "[ab]"})
    assert structured_outputs(req) == StructuredOutputsParams(regex="[ab]")


def test_sampling_params_carry_the_structured_output():
    engine = SimpleNamespace(
        model_config=SimpleNamespace(name="m", max_model_len=64, generation_config={}),
        tokenizer=None,
    )
    serving = OpenAIServing(engine)  # type: ignore[arg-type]
    params = serving.sampling_params(
        chat(response_format=json_schema()), 16, RequestOutputKind.FINAL_ONLY
    )
    assert params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
    assert params.structured_outputs.disable_any_whitespace
    plain = serving.sampling_params(chat(), 16, RequestOutputKind.FINAL_ONLY)
    assert plain.structured_outputs is None


def test_batch_bodies_take_the_fields():
    for url in (COMPLETIONS_URL, CHAT_URL):
        body = {"response_format": json_schema(), "guided_choice": None}
        body |= {"prompt": "x"} if url == COMPLETIONS_URL else {"messages": MESSAGES}
        line = {"custom_id": "1", "method": "POST", "url": url, "body": body}
        assert _openai_body(line) == (url, body)


def test_package_exports_the_params():
    import inferengine

    assert inferengine.StructuredOutputsParams is StructuredOutputsParams
    assert "StructuredOutputsParams" in inferengine.__all__


# ---- through the server: a 400 before anything is queued -------------------------------------


@pytest.fixture(scope="module")
def client(tiny_server):
    with tiny_server.client() as c:
        yield c


@pytest.mark.parametrize(
    ("url", "fields", "param"),
    [
        ("/v1/chat/completions", {"guided_regex": "[a-z"}, "guided_regex"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"name": "r"}}},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/completions",
            {"response_format": json_schema(schema={"type": "foo"}), "stream": True},
            "response_format.json_schema.schema",
        ),
        (
            "/v1/completions",
            {"structured_outputs": {"choice": ["a"]}, "guided_json": SCHEMA},
            "guided_json",
        ),
        (
            "/v1/generate",
            {"structured_outputs": {"grammar": "start: x"}},
            "structured_outputs.grammar",
        ),
        ("/v1/chat/completions", {"response_format": "json"}, "response_format"),
        ("/v1/chat/completions", {"guided_choice": "yes"}, "guided_choice"),
    ],
)
def test_server_refuses_with_400(client, url, fields, param):
    body = {"model": SERVED_NAME, "max_tokens": 4, **fields}
    body |= {"messages": MESSAGES} if "chat" in url else {"prompt": "Hello"}
    response = client.post(url, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
