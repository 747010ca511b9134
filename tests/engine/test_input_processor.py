"""Prompts to engine-core requests: tokenization, EOS ids, chat templates, and every check a
prompt must pass, each refusal naming what is wrong."""

from __future__ import annotations

import pytest

from inferengine.config import ModelConfig
from inferengine.engine.input_processor import InputProcessor
from inferengine.errors import InvalidRequestError
from inferengine.retention import Retention
from inferengine.sampling_params import SamplingParams
from tests.conftest import EOS_ID, VOCAB_SIZE, build_tokenizer

TOK = build_tokenizer()
MESSAGES = [{"role": "user", "content": "Hello"}]


def model_config(
    max_model_len: int = 16, generation_config: dict | None = None, **hf
) -> ModelConfig:
    return ModelConfig(
        model="tiny",
        model_path="/nonexistent",
        hf_config={"vocab_size": VOCAB_SIZE, "eos_token_id": EOS_ID, **hf},
        dtype="float32",
        max_model_len=max_model_len,
        generation_config=generation_config or {},
    )


def processor(tokenizer=TOK, policy: str = "fcfs", **config) -> InputProcessor:
    return InputProcessor(model_config(**config), tokenizer, policy)


# ---- tokenization ------------------------------------------------------------------------


def test_every_prompt_form_tokenizes():
    p = processor()
    ids = TOK.encode("Hello world")
    assert p.tokenize("Hello world") == ("Hello world", ids)
    assert p.tokenize([5, 6, 7]) == (None, [5, 6, 7])
    assert p.tokenize({"prompt": "Hello world"}) == ("Hello world", ids)
    # ids win over the text, which is kept as the prompt's text
    assert p.tokenize({"prompt": "ignored", "prompt_token_ids": (5, 6)}) == ("ignored", [5, 6])
    assert p.tokenize({"prompt_token_ids": [9]}) == (None, [9])


@pytest.mark.parametrize(
    ("prompt", "words"),
    [
        ({"text": "hi"}, "a prompt dict needs 'prompt' or 'prompt_token_ids'"),
        (5, "a prompt must be a string, a list of token ids or a dict; got int"),
        ([5, "a"], "got list"),
        (None, "got NoneType"),
    ],
)
def test_prompts_of_no_known_form_are_refused(prompt, words):
    with pytest.raises(InvalidRequestError, match=words):
        processor().tokenize(prompt)


def test_text_without_a_tokenizer_is_refused_but_ids_pass():
    p = processor(tokenizer=None)
    with pytest.raises(InvalidRequestError, match="this engine has no tokenizer; send token ids"):
        p.tokenize("Hello")
    assert p.tokenize([5]) == (None, [5])
    with pytest.raises(InvalidRequestError, match="no tokenizer, so no chat template"):
        p.apply_chat_template(MESSAGES)


# ---- end-of-sequence ids -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("generation_eos", "hf_eos", "eos", "extra"),
    [
        (None, EOS_ID, EOS_ID, []),  # config.json's eos, the tokenizer's too
        ([EOS_ID, 7], EOS_ID, EOS_ID, [7]),  # generation_config.json's list wins
        ([7, 8], EOS_ID, EOS_ID, [7, 8]),  # the tokenizer's eos comes first
        (9, None, EOS_ID, [9]),
    ],
)
def test_eos_ids_merge_the_generation_config_and_the_tokenizer(generation_eos, hf_eos, eos, extra):
    gen = {} if generation_eos is None else {"eos_token_id": generation_eos}
    p = processor(generation_config=gen, eos_token_id=hf_eos)
    assert (p.eos_token_id, p.extra_stop_token_ids) == (eos, extra)


def test_no_eos_anywhere():
    p = processor(tokenizer=None, eos_token_id=None)
    assert (p.eos_token_id, p.extra_stop_token_ids) == (None, [])


def test_extra_eos_ids_become_stop_ids_unless_eos_is_ignored():
    p = processor(generation_config={"eos_token_id": [EOS_ID, 7, 8]})
    request = p.make_request("r", [5, 6], SamplingParams())
    assert request.eos_token_id == EOS_ID
    assert request.sampling_params.extra_stop_token_ids == [7, 8]
    ignoring = p.make_request("s", [5, 6], SamplingParams(ignore_eos=True))
    assert ignoring.sampling_params.extra_stop_token_ids == []


# ---- requests ----------------------------------------------------------------------------


def test_make_request_carries_everything_the_core_needs():
    p = processor(policy="priority")
    params = SamplingParams(max_tokens=3)
    retention = Retention(key="chat-1", ttl_s=60.0, breakpoints=((2, 300.0),))
    request = p.make_request(
        "r", [5, 6, 7], params, arrival_time=12.5, priority=-1, cache_salt="s", retention=retention
    )
    assert (request.request_id, request.prompt_token_ids) == ("r", [5, 6, 7])
    assert request.sampling_params is params
    assert (request.arrival_time, request.priority, request.cache_salt) == (12.5, -1, "s")
    assert (request.cache_key, request.cache_ttl_s) == ("chat-1", 60.0)
    assert request.cache_breakpoints == [(2, 300.0)]
    plain = p.make_request("q", [5], SamplingParams())
    assert (plain.cache_key, plain.cache_ttl_s, plain.cache_breakpoints) == (None, None, [])
    assert plain.arrival_time > 0  # stamped now when not given


@pytest.mark.parametrize("num_tokens", [0, 4])
def test_a_breakpoint_must_cover_part_of_the_prompt(num_tokens):
    retention = Retention(breakpoints=((num_tokens, 300.0),))
    with pytest.raises(
        InvalidRequestError,
        match=f"a cache breakpoint covers {num_tokens} tokens of a 3-token prompt; it must "
        "cover 1 to all of them",
    ):
        processor().make_request("r", [5, 6, 7], SamplingParams(), retention=retention)


def test_a_prompt_of_exactly_max_model_len_passes_one_more_is_refused():
    p = processor(max_model_len=16)
    p.validate([5] * 16, SamplingParams())
    with pytest.raises(InvalidRequestError) as info:
        p.validate([5] * 17, SamplingParams())
    assert info.value.message == (
        "the prompt has 17 tokens, more than this model's maximum context length (16). "
        "Shorten the prompt, or start the engine with a larger --max-model-len."
    )
    assert info.value.param == "prompt"


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        ([], "the prompt is empty; send at least one token."),
        ([5, VOCAB_SIZE], f"prompt token id {VOCAB_SIZE} is outside the vocabulary [0, 320)."),
        ([-1, 5], "prompt token id -1 is outside the vocabulary [0, 320)."),
        ([5, 6.0], "prompt token ids must be integers; got float 6.0."),
        ([5, True], "prompt token ids must be integers; got bool True."),
        (["input_ids"], "prompt token ids must be integers; got str 'input_ids'."),
    ],
)
def test_bad_prompt_ids_are_refused_naming_the_first_bad_one(ids, message):
    with pytest.raises(InvalidRequestError) as info:
        processor().validate(ids, SamplingParams())
    assert info.value.message.startswith(message)
    assert info.value.param == "prompt"


def test_sampling_ids_outside_the_vocabulary_are_refused():
    with pytest.raises(InvalidRequestError, match="logit_bias names token id 320, outside"):
        processor().validate([5], SamplingParams(logit_bias={320: 1.0}))


def test_a_priority_needs_priority_scheduling():
    processor(policy="priority").validate([5], SamplingParams(), priority=7)
    processor().validate([5], SamplingParams(), priority=0)
    with pytest.raises(InvalidRequestError, match="priority 7 needs priority scheduling") as e:
        processor().validate([5], SamplingParams(), priority=7)
    assert e.value.param == "priority"


# ---- chat templates ----------------------------------------------------------------------


def test_chat_prompt_renders_the_template_and_keeps_its_special_tokens():
    p = processor()
    prompt = p.chat_prompt(MESSAGES)
    assert prompt["prompt"] == "<s>user: Hello\n<s>assistant:"
    ids = prompt["prompt_token_ids"]
    assert ids[0] == TOK.bos_token_id and ids.count(TOK.bos_token_id) == 2
    assert TOK.decode(ids) == prompt["prompt"]
    assert p.apply_chat_template(MESSAGES, add_generation_prompt=False) == "<s>user: Hello\n"


def test_a_passed_template_wins_and_template_kwargs_reach_it():
    template = "{% for m in messages %}[{{ m['content'] }}|{{ flavour }}]{% endfor %}"
    p = processor()
    assert p.apply_chat_template(MESSAGES, chat_template=template, flavour="x") == "[Hello|x]"


def test_a_tokenizer_without_a_template_or_a_broken_one_is_refused():
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(InvalidRequestError, match="the model's tokenizer has no chat template"):
        processor(tokenizer=bare).apply_chat_template(MESSAGES)
    broken = "{{ raise_exception('only user turns') }}"
    with pytest.raises(
        InvalidRequestError, match="cannot apply the chat template to these messages: only user"
    ):
        processor().apply_chat_template(MESSAGES, chat_template=broken)
