"""Stop strings across token boundaries, streaming deltas, and `n` fan-in."""

from __future__ import annotations

from inferengine.core.engine_io import EngineCoreOutput
from inferengine.core.request import FinishReason
from inferengine.engine.output_processor import OutputProcessor, ParentRequest
from inferengine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import build_tokenizer

TOK = build_tokenizer()


def _feed(processor: OutputProcessor, request_id: str, text: str, finish_at_end: bool = False):
    """Send the text's tokens one at a time; collect outputs and aborts."""
    ids = TOK.encode(text, add_special_tokens=False)
    outputs, aborts = [], []
    for i, t in enumerate(ids):
        last = finish_at_end and i == len(ids) - 1
        out = EngineCoreOutput(request_id, [t], finish_reason=FinishReason.LENGTH if last else None)
        ready, abort = processor.process_outputs([out])
        outputs += ready
        aborts += abort
        if request_id not in processor.requests:
            break
    return outputs, aborts


def _add(processor, request_id, **params):
    processor.add_request(request_id, None, [5, 6], SamplingParams(**params))


def test_stop_string_split_across_tokens_truncates_and_aborts():
    processor = OutputProcessor(TOK)
    _add(processor, "r", stop=["quick brown"], output_kind=RequestOutputKind.FINAL_ONLY)
    outputs, aborts = _feed(processor, "r", "The quick brown fox jumps")
    assert aborts == ["r"]
    (final,) = outputs
    assert final.outputs[0].text == "The "
    assert final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == "quick brown"


def test_include_stop_str_in_output():
    processor = OutputProcessor(TOK)
    _add(
        processor,
        "r",
        stop=["brown"],
        include_stop_str_in_output=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    outputs, _ = _feed(processor, "r", "The quick brown fox")
    assert outputs[-1].outputs[0].text == "The quick brown"


def test_streaming_deltas_never_show_part_of_a_stop_string():
    processor = OutputProcessor(TOK)
    _add(processor, "r", stop=["lazy dog"], output_kind=RequestOutputKind.DELTA)
    outputs, _ = _feed(processor, "r", "over the lazy dog and more")
    streamed = "".join(o.outputs[0].text for o in outputs)
    assert streamed == "over the "
    assert "lazy"[:2] not in streamed.replace("over the ", "")


def test_deltas_add_up_to_the_cumulative_text():
    processor = OutputProcessor(TOK)
    _add(processor, "d", output_kind=RequestOutputKind.DELTA)
    _add(processor, "c", output_kind=RequestOutputKind.CUMULATIVE)
    text = "Paris is the capital of France. Zürich 🙂"
    deltas, _ = _feed(processor, "d", text, finish_at_end=True)
    cumulative, _ = _feed(processor, "c", text, finish_at_end=True)
    assert "".join(o.outputs[0].text for o in deltas) == cumulative[-1].outputs[0].text == text
    assert cumulative[-1].finished and cumulative[-1].outputs[0].finish_reason == "length"


def test_n_children_are_gathered_into_one_final_output():
    processor = OutputProcessor(TOK)
    params = SamplingParams(n=2, output_kind=RequestOutputKind.FINAL_ONLY)
    parent = ParentRequest("p", 2, params.output_kind)
    for i in range(2):
        child = params.clone()
        child.n = 1
        processor.add_request(f"{i}_p", None, [5], child, parent=parent, index=i)
    first, _ = processor.process_outputs([EngineCoreOutput("1_p", [40], FinishReason.LENGTH)])
    assert first == []
    done, _ = processor.process_outputs([EngineCoreOutput("0_p", [41], FinishReason.LENGTH)])
    (out,) = done
    assert out.request_id == "p" and out.finished
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [[41], [40]]
