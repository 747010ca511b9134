"""Every architecture matches Transformers on the same weights: logits and greedy tokens."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import TINY_ARCHS, hf_greedy, hf_model
from tests.model.paged_runner import PagedLoop, load_tiny

ARCHS = sorted(TINY_ARCHS)


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 7, 16, 33, 130]
    return [torch.randint(2, 320, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_logits_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, config = load_tiny(path)
    reference = hf_model(path)
    prompts = _prompts(1)
    loop = PagedLoop(model, config, num_seqs=len(prompts))
    ours = loop.step(prompts)
    for prompt, logits in zip(prompts, ours, strict=True):
        with torch.no_grad():
            expected = reference(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_decode_through_paged_cache_matches_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    model, config = load_tiny(path)
    reference = hf_model(path)
    prompts = _prompts(2)
    loop = PagedLoop(model, config, num_seqs=len(prompts))
    outputs: list[list[int]] = [[] for _ in prompts]
    logits = loop.step(prompts)
    for _ in range(32):
        next_tokens = [[int(lg[-1].argmax())] for lg in logits]
        for out, token in zip(outputs, next_tokens, strict=True):
            out.extend(token)
        logits = loop.step(next_tokens)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out == hf_greedy(reference, prompt, 32)


def test_chunked_prefill_gives_the_same_logits(tiny_checkpoint):
    """A prompt fed in chunks (prefix already in the cache) gives the same logits as in one go."""
    model, config = load_tiny(tiny_checkpoint("qwen3"))
    prompt = _prompts(3)[-1]
    whole = PagedLoop(model, config, num_seqs=1).step([prompt])[0]
    loop = PagedLoop(model, config, num_seqs=1)
    parts = [loop.step([prompt[a:b]])[0] for a, b in ((0, 50), (50, 51), (51, 130))]
    torch.testing.assert_close(torch.cat(parts), whole, atol=1e-5, rtol=0)
