"""The default model (SmolLM2-135M-Instruct from its PyPI GGUF) answers through our engine."""

from __future__ import annotations

from inferengine import LLM, SamplingParams


def test_default_model_knows_the_capital_of_france():
    llm = LLM(max_model_len=512)  # the default model, fetched and converted once
    question = [{"role": "user", "content": "What is the capital of France?"}]
    output = llm.chat(question, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    answer = output.outputs[0].text
    assert "Paris" in answer, answer
    assert output.outputs[0].finish_reason in ("stop", "length")


def test_generate_command_prints_the_answer(capsys):
    from inferengine.entrypoints.cli.main import main

    code = main(["generate", "What is the capital of France?", "--max-tokens", "24"])
    assert code == 0
    assert "Paris" in capsys.readouterr().out
