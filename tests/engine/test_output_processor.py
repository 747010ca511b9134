"""Stop strings across token boundaries, streaming deltas, and `n` fan-in."""

from __future__ import annotations

from inferengine.core.engine_io import EngineCoreOutput, LogprobsLists
from inferengine.core.request import FinishReason
from inferengine.engine.output_processor import OutputProcessor, ParentRequest
from inferengine.metrics.stats import IterationStats
from inferengine.outputs import Logprob
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


# ---- stop strings, finish reasons --------------------------------------------------------


def _ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def test_several_stop_strings_in_one_output_stop_at_the_earliest():
    """Several tokens arrive at once (speculative decoding accepts drafts): the text ends
    before the first stop string in it, whatever the order the stop strings were listed in."""
    processor = OutputProcessor(TOK)
    _add(processor, "r", stop=["fox", "quick"])
    ready, aborts = processor.process_outputs([EngineCoreOutput("r", _ids("The quick brown fox"))])
    assert aborts == ["r"]
    (completion,) = ready[0].outputs
    assert completion.text == "The "
    assert completion.stop_reason == "quick"
    assert completion.finish_reason == "stop"


def test_a_stop_string_in_the_first_output_of_many_tokens():
    processor = OutputProcessor(TOK)
    _add(processor, "r", stop=["brown"], include_stop_str_in_output=True)
    ready, aborts = processor.process_outputs([EngineCoreOutput("r", _ids("The quick brown fox"))])
    assert aborts == ["r"]
    assert ready[0].outputs[0].text == "The quick brown"
    assert ready[0].finished and "r" not in processor.requests
    # the tokens past the stop string stay in token_ids (the core produced them)
    assert ready[0].outputs[0].token_ids == _ids("The quick brown fox")


def test_a_stop_string_that_never_completes_is_shown_once_the_request_ends():
    """Text that might start a stop string is held back while streaming, and let out when the
    request ends without it."""
    processor = OutputProcessor(TOK)
    _add(processor, "r", stop=["fox jumps"], output_kind=RequestOutputKind.DELTA)
    ids = _ids("The quick brown fox")
    deltas, aborts = _feed(processor, "r", "The quick brown fox", finish_at_end=True)
    assert aborts == []
    assert deltas[-1].outputs[0].text.endswith("fox")
    assert "".join(d.outputs[0].text for d in deltas) == "The quick brown fox"
    assert sum(len(d.outputs[0].token_ids) for d in deltas) == len(ids)
    assert deltas[-1].outputs[0].finish_reason == "length"


def test_cumulative_text_holds_back_what_may_start_a_stop_string():
    processor = OutputProcessor(TOK)
    _add(processor, "r", stop=["xyz"])  # 3 characters: the last 2 may start it
    (out,), _ = processor.process_outputs([EngineCoreOutput("r", _ids("Hello world"))])
    assert out.outputs[0].text == "Hello wor"
    assert not out.finished
    (out,), _ = processor.process_outputs(
        [EngineCoreOutput("r", _ids(" today"), finish_reason=FinishReason.LENGTH)]
    )
    assert out.outputs[0].text == "Hello world today"


def test_a_stop_token_reports_its_id_and_an_abort_its_reason():
    processor = OutputProcessor(TOK)
    _add(processor, "s")
    _add(processor, "a")
    ready, aborts = processor.process_outputs(
        [
            EngineCoreOutput("s", [40, 1], finish_reason=FinishReason.STOP, stop_reason=1),
            EngineCoreOutput("a", [41], finish_reason=FinishReason.ABORT),
        ]
    )
    assert aborts == []  # the core ended both itself
    stop, abort = (o.outputs[0] for o in ready)
    assert (stop.finish_reason, stop.stop_reason, stop.token_ids) == ("stop", 1, [40, 1])
    assert stop.text == TOK.decode([40])  # </s> is a special token, skipped
    assert (abort.finish_reason, abort.stop_reason) == ("abort", None)
    assert not processor.has_unfinished_requests()


def test_final_only_waits_and_an_error_reaches_the_output():
    processor = OutputProcessor(TOK)
    _add(processor, "r", output_kind=RequestOutputKind.FINAL_ONLY)
    assert processor.process_outputs([EngineCoreOutput("r", [40])]) == ([], [])
    ready, _ = processor.process_outputs(
        [EngineCoreOutput("r", [], finish_reason=FinishReason.ABORT)],
        errors={"r": "prompt token id 999 is outside the vocabulary"},
    )
    (out,) = ready
    assert out.finished and out.error == "prompt token id 999 is outside the vocabulary"
    assert out.outputs[0].token_ids == [40]


def test_outputs_of_unknown_or_aborted_requests_are_dropped():
    processor = OutputProcessor(TOK)
    _add(processor, "r")
    processor.abort(["r", "never-added"])
    assert not processor.has_unfinished_requests()
    assert processor.process_outputs([EngineCoreOutput("r", [40])]) == ([], [])


def test_without_detokenize_there_is_no_text_and_stop_strings_do_not_apply():
    processor = OutputProcessor(TOK)
    _add(processor, "r", detokenize=False, stop=["quick"])
    ids = _ids("The quick brown")
    (out,), aborts = processor.process_outputs(
        [EngineCoreOutput("r", ids, finish_reason=FinishReason.LENGTH)]
    )
    assert aborts == []
    assert out.outputs[0].text == "" and out.outputs[0].token_ids == ids


def test_an_engine_without_a_tokenizer_passes_token_ids_through():
    processor = OutputProcessor(None)
    processor.add_request("r", None, [5], SamplingParams(logprobs=0))
    lp = LogprobsLists([[40]], [[-0.5]], [2])
    (out,), _ = processor.process_outputs([EngineCoreOutput("r", [40], new_logprobs=lp)])
    assert out.outputs[0].text == ""
    assert out.outputs[0].logprobs == [{40: Logprob(-0.5, 2, "")}]


# ---- logprobs ----------------------------------------------------------------------------


def test_sample_logprobs_keep_the_chosen_token_and_the_top_ones_with_ranks():
    processor = OutputProcessor(TOK)
    _add(processor, "r", logprobs=2, output_kind=RequestOutputKind.DELTA)
    # position 0: the chosen token 40 is the most likely; position 1: 41 is ranked 7th
    first = LogprobsLists([[40, 40, 50]], [[-0.1, -0.1, -2.5]], [1])
    second = LogprobsLists([[41, 60, 61]], [[-3.0, -0.2, -1.9]], [7])
    (a,), _ = processor.process_outputs([EngineCoreOutput("r", [40], new_logprobs=first)])
    (b,), _ = processor.process_outputs(
        [EngineCoreOutput("r", [41], FinishReason.LENGTH, new_logprobs=second)]
    )
    d = TOK.decode
    assert a.outputs[0].logprobs == [{40: Logprob(-0.1, 1, d([40])), 50: Logprob(-2.5, 2, d([50]))}]
    # a delta carries only the new position; the chosen token comes with its true rank
    assert b.outputs[0].logprobs == [
        {
            60: Logprob(-0.2, 1, d([60])),
            61: Logprob(-1.9, 2, d([61])),
            41: Logprob(-3.0, 7, d([41])),
        }
    ]
    assert a.outputs[0].cumulative_logprob == -0.1
    assert b.outputs[0].cumulative_logprob == -0.1 + -3.0


def test_without_logprobs_asked_there_are_none():
    processor = OutputProcessor(TOK)
    _add(processor, "r")
    lp = LogprobsLists([[40]], [[-0.5]], [1])
    (out,), _ = processor.process_outputs([EngineCoreOutput("r", [40], new_logprobs=lp)])
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None
    assert out.prompt_logprobs is None


def test_prompt_logprobs_fill_positions_from_the_second_on_over_chunks():
    """A chunked prefill sends prompt logprobs in pieces; `start` is the row of the first."""
    processor = OutputProcessor(TOK)
    processor.add_request("r", None, [5, 6, 7, 8], SamplingParams(prompt_logprobs=0))
    chunk1 = LogprobsLists([[6], [7]], [[-1.0], [-2.0]], [3, 4], start=0)
    chunk2 = LogprobsLists([[8]], [[-3.0]], [5], start=2)
    assert processor.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)])
    (out,), _ = processor.process_outputs(
        [EngineCoreOutput("r", [40], FinishReason.LENGTH, new_prompt_logprobs=chunk2)]
    )
    d = TOK.decode
    assert out.prompt_logprobs == [
        None,
        {6: Logprob(-1.0, 3, d([6]))},
        {7: Logprob(-2.0, 4, d([7]))},
        {8: Logprob(-3.0, 5, d([8]))},
    ]


# ---- n > 1 -------------------------------------------------------------------------------


def _add_children(processor, n: int, **params) -> None:
    sampling = SamplingParams(n=n, **params)
    parent = ParentRequest("p", n, sampling.output_kind)
    for i in range(n):
        child = sampling.clone()
        child.n = 1
        processor.add_request(f"{i}_p", None, [5], child, parent=parent, index=i)


def test_n_children_stream_their_own_deltas_under_the_parents_id():
    processor = OutputProcessor(TOK)
    _add_children(processor, 2, output_kind=RequestOutputKind.DELTA)
    (a,), _ = processor.process_outputs([EngineCoreOutput("1_p", [40])])
    (b,), _ = processor.process_outputs([EngineCoreOutput("0_p", [41], FinishReason.LENGTH)])
    (c,), _ = processor.process_outputs([EngineCoreOutput("1_p", [42], FinishReason.LENGTH)])
    assert [o.request_id for o in (a, b, c)] == ["p", "p", "p"]
    assert [(o.outputs[0].index, o.outputs[0].token_ids) for o in (a, b, c)] == [
        (1, [40]),
        (0, [41]),
        (1, [42]),
    ]
    # the parent is finished when its last child is
    assert [o.finished for o in (a, b, c)] == [False, False, True]
    assert processor.parents == {} and not processor.has_unfinished_requests()


def test_n_children_cumulative_outputs_show_every_child_so_far():
    processor = OutputProcessor(TOK)
    _add_children(processor, 3)
    (a,), _ = processor.process_outputs([EngineCoreOutput("2_p", [40])])
    assert [c.index for c in a.outputs] == [2]
    ready, _ = processor.process_outputs(
        [EngineCoreOutput("0_p", [41], FinishReason.LENGTH), EngineCoreOutput("2_p", [42])]
    )
    assert [[c.token_ids for c in o.outputs] for o in ready] == [[[41], [40]], [[41], [40, 42]]]
    ready, _ = processor.process_outputs(
        [
            EngineCoreOutput("1_p", [43], FinishReason.LENGTH),
            EngineCoreOutput("2_p", [44], FinishReason.LENGTH),
        ]
    )
    assert [o.finished for o in ready] == [False, True]
    assert [c.token_ids for c in ready[-1].outputs] == [[41], [43], [40, 42, 44]]
    assert [c.finish_reason for c in ready[-1].outputs] == ["length"] * 3


def test_a_stop_string_aborts_only_the_child_that_wrote_it():
    processor = OutputProcessor(TOK)
    _add_children(processor, 2, stop=["brown"], output_kind=RequestOutputKind.FINAL_ONLY)
    ready, aborts = processor.process_outputs(
        [EngineCoreOutput("0_p", _ids("The quick brown")), EngineCoreOutput("1_p", _ids("The"))]
    )
    assert (ready, aborts) == ([], ["0_p"])
    ready, aborts = processor.process_outputs([EngineCoreOutput("1_p", [40], FinishReason.LENGTH)])
    (out,) = ready
    assert aborts == [] and out.finished
    assert [(c.text, c.finish_reason) for c in out.outputs] == [
        ("The quick ", "stop"),
        ("The" + TOK.decode([40]), "length"),
    ]


# ---- stats -------------------------------------------------------------------------------


def test_iteration_stats_count_tokens_latencies_and_finished_requests():
    processor = OutputProcessor(TOK)
    processor.add_request("r", None, [5, 6, 7], SamplingParams(), arrival_time=100.0)
    first = IterationStats()
    processor.process_outputs(
        [EngineCoreOutput("r", [40, 41], queued_time=100.5, scheduled_time=101.0)], stats=first
    )
    assert (first.num_prompt_tokens, first.num_generation_tokens) == (3, 2)
    assert len(first.time_to_first_tokens) == 1 and first.inter_token_latencies == []
    second = IterationStats()
    processor.process_outputs([EngineCoreOutput("r", [42], FinishReason.LENGTH)], stats=second)
    assert (second.num_prompt_tokens, second.num_generation_tokens) == (0, 1)
    assert len(second.inter_token_latencies) == 1 and second.time_to_first_tokens == []
    (done,) = second.finished
    assert done.finish_reason == "length"
    assert (done.num_prompt_tokens, done.num_generation_tokens) == (3, 3)
    assert done.queue_time == 0.5  # queued at 100.5, scheduled at 101.0


def test_aborting_an_unfinished_request_counts_it_as_finished_by_abort():
    processor = OutputProcessor(TOK)
    _add(processor, "r")
    _add(processor, "done")
    processor.process_outputs(
        [EngineCoreOutput("r", [40]), EngineCoreOutput("done", [40], FinishReason.LENGTH)]
    )
    stats = IterationStats()
    processor.abort(["r", "done"], stats)
    (aborted,) = stats.finished  # "done" had finished already: not counted again
    assert aborted.finish_reason == "abort" and aborted.num_generation_tokens == 1
