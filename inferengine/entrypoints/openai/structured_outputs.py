"""The request fields that ask for structured output (OpenAI's `response_format`, vLLM's
`structured_outputs` and its older `guided_*`) to one `StructuredOutputsParams`, checked by
llguidance before the request is queued; a bad shape or grammar is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import StructuredOutputsParams
from inferengine.structured_output.grammar import check_grammar

# vLLM's older request fields, each one kind of `StructuredOutputsParams`.
GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
# `guided_decoding_backend` values accepted (and ignored): the backend here is llguidance.
_BACKENDS = ("auto", "guidance", "llguidance")
_FIELDS = ("response_format", "structured_outputs", *GUIDED_FIELDS)
_TYPES: dict[str, tuple[type, ...]] = {
    "json": (dict, str),
    "regex": (str,),
    "choice": (list,),
    "grammar": (str,),
    "json_object": (bool,),
}
_REFUSED_KEYS = {
    "disable_additional_properties": "a schema says so itself with additionalProperties false",
    "whitespace_pattern": "JSON is always generated without whitespace between tokens",
    "structural_tag": "structural tags are not implemented",
}


def asking_fields(req: Any) -> list[str]:
    """The request's fields that ask for structured output (response_format "text" does not)."""
    asking = [name for name in _FIELDS if getattr(req, name) is not None]
    if req.response_format is not None and req.response_format.get("type") == "text":
        asking.remove("response_format")
    return asking


def structured_outputs(req: Any) -> StructuredOutputsParams | None:
    """The structured output the request asks for, its grammar checked; None when no field asks.
    More than one field asking is a 400 naming both."""
    _check_backend(req.guided_decoding_backend)
    asking = asking_fields(req)
    if not asking:
        return None
    if len(asking) > 1:
        raise InvalidRequestError(
            f"{asking[0]} and {asking[1]} both ask for structured output; send only one of them.",
            param=asking[1],
        )
    field = asking[0]
    value = getattr(req, field)
    if field == "response_format":
        params = _from_response_format(value)
    elif field == "structured_outputs":
        params = _from_structured_outputs(value)
    else:
        params = _make(field, **{GUIDED_FIELDS[field]: value})
    _check_grammar(params, field)
    return params


def _check_grammar(params: StructuredOutputsParams, field: str) -> None:
    """A 400 naming `field` when llguidance refuses the schema, regex or grammar."""
    try:
        check_grammar(params, None)  # the syntax; the engine compiles it for the vocabulary
    except InvalidRequestError as e:
        raise InvalidRequestError(e.message, param=_param(field, params.kind)) from None


def _param(field: str, kind: str) -> str:
    if field == "response_format":
        return "response_format.json_schema.schema" if kind == "json" else field
    if field == "structured_outputs":
        return f"structured_outputs.{kind}"
    return field


def _make(field: str, **kwargs: Any) -> StructuredOutputsParams:
    """`StructuredOutputsParams(**kwargs)`, its errors naming the request's `field`."""
    try:
        return StructuredOutputsParams(**kwargs)
    except InvalidRequestError as e:
        param = e.param if field == "structured_outputs" else field
        raise InvalidRequestError(e.message, param=param) from None


def _from_response_format(value: dict[str, Any]) -> StructuredOutputsParams:
    kind = value.get("type")
    if kind == "json_object":
        return _make("response_format", json_object=True)
    if kind != "json_schema":
        raise InvalidRequestError(
            f"response_format type {kind!r} is not supported; use 'text', 'json_object' or "
            "'json_schema'.",
            param="response_format.type",
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise InvalidRequestError(
            'response_format of type json_schema needs a "json_schema" object with a name and '
            "a schema.",
            param="response_format.json_schema",
        )
    name = spec.get("name")
    if not isinstance(name, str) or not name:
        raise InvalidRequestError(
            "response_format.json_schema.name is required: a name for the schema.",
            param="response_format.json_schema.name",
        )
    if "schema" not in spec:
        raise InvalidRequestError(
            "response_format.json_schema.schema is required: the JSON schema of the reply.",
            param="response_format.json_schema.schema",
        )
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError(
            "response_format.json_schema.strict must be a boolean.",
            param="response_format.json_schema.strict",
        )
    schema = spec["schema"]
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            "response_format.json_schema.schema must be a JSON object.",
            param="response_format.json_schema.schema",
        )
    # Strict or not, the schema is enforced.
    return _make("response_format.json_schema.schema", json=schema)


def _from_structured_outputs(value: dict[str, Any]) -> StructuredOutputsParams:
    kwargs: dict[str, Any] = {}
    for key, item in value.items():
        param = f"structured_outputs.{key}"
        if item is None:
            continue
        if key == "disable_any_whitespace":
            if item is not True:
                raise InvalidRequestError(
                    "structured_outputs.disable_any_whitespace can only be true: JSON is always "
                    "generated without whitespace between tokens.",
                    param=param,
                )
        elif key in _REFUSED_KEYS:
            if item is not False:
                raise InvalidRequestError(
                    f"{param} is not supported: {_REFUSED_KEYS[key]}.", param=param
                )
        elif key in _TYPES:
            if not isinstance(item, _TYPES[key]):
                raise InvalidRequestError(
                    f"{param} has the wrong type ({type(item).__name__}).", param=param
                )
            kwargs[key] = item
        else:
            raise InvalidRequestError(
                f"{param} is not a structured output key; use one of json, regex, choice, "
                "grammar or json_object.",
                param=param,
            )
    return _make("structured_outputs", **kwargs)


def _check_backend(backend: str | None) -> None:
    if backend is not None and backend not in _BACKENDS:
        raise InvalidRequestError(
            f"guided_decoding_backend {backend!r} is not available: structured output here "
            f"always uses llguidance (send one of {', '.join(_BACKENDS)}, or leave it out).",
            param="guided_decoding_backend",
        )
