"""Request arrival times: Poisson and gamma gaps at the requested rate, and sends that follow them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from inferengine.bench.config import DatasetConfig, ServeConfig, WorkloadConfig
from inferengine.bench.runner import arrival_offsets, run_serve


def ks_statistic_exponential(gaps: np.ndarray, mean: float) -> float:
    """Kolmogorov-Smirnov distance between the gaps' empirical CDF and Exp(mean)."""
    x = np.sort(gaps)
    n = x.size
    cdf = 1.0 - np.exp(-x / mean)
    upper = np.arange(1, n + 1) / n - cdf
    lower = cdf - np.arange(0, n) / n
    return float(max(upper.max(), lower.max()))


def gaps_of(offsets: np.ndarray) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], offsets]))


def test_poisson_gaps_are_exponential_at_the_rate():
    n, rate = 4000, 20.0
    gaps = gaps_of(arrival_offsets(n, rate, 1.0, seed=0))
    assert gaps.min() >= 0
    # Rescaled so that the last request goes out at n / rate.
    assert gaps.sum() == pytest.approx(n / rate)
    # KS test at the 1% level: critical distance 1.63 / sqrt(n).
    assert ks_statistic_exponential(gaps, 1.0 / rate) < 1.63 / math.sqrt(n)
    # ...and it does reject a clearly different distribution (the test has teeth).
    assert ks_statistic_exponential(gaps, 2.0 / rate) > 1.63 / math.sqrt(n)


@pytest.mark.parametrize("burstiness", [0.25, 0.5, 2.0, 4.0])
def test_gamma_gaps_have_the_rate_and_burstiness(burstiness):
    n, rate = 4000, 10.0
    gaps = gaps_of(arrival_offsets(n, rate, burstiness, seed=1))
    assert gaps.mean() == pytest.approx(1.0 / rate)
    # Gamma with shape k: squared coefficient of variation 1 / k.
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1.0 / burstiness, rel=0.15)


def test_gaps_are_the_ones_vllm_draws_for_the_same_seed():
    n, rate, b, seed = 50, 5.0, 0.5, 11
    np_state = np.random.RandomState(seed)  # what np.random.seed(seed) sets up in vLLM
    draws = np.cumsum([np_state.gamma(shape=b, scale=1.0 / (rate * b)) for _ in range(n)])
    want = draws * (n / rate) / draws[-1]
    np.testing.assert_allclose(arrival_offsets(n, rate, b, seed), want)


def test_infinite_rate_and_infinite_burstiness():
    assert not arrival_offsets(5, math.inf, 1.0, 0).any()
    np.testing.assert_allclose(arrival_offsets(4, 2.0, math.inf, 0), [0.5, 1.0, 1.5, 2.0])


def test_sends_follow_the_schedule(fake_server, tokenizer_dir):
    server = fake_server(ttft_ms=1, token_delay_ms=0)
    n, rate = 60, 100.0
    cfg = ServeConfig(
        workload=WorkloadConfig(
            dataset=DatasetConfig(num_prompts=n, random_input_len=8, random_output_len=2, seed=5),
            request_rate=rate,
            ignore_eos=True,
        ),
        base_url=server.base_url,
        tokenizer=str(tokenizer_dir),
        disable_tqdm=True,
    )
    result = run_serve(cfg)
    assert result["completed"] == n
    sent = np.asarray(result["start_times"])
    planned = arrival_offsets(n, rate, 1.0, seed=5)
    # Each request leaves at its planned time, give or take event-loop jitter.
    assert np.all(sent >= planned - 0.005)
    assert np.median(sent - planned) < 0.02
    assert sent[-1] == pytest.approx(n / rate, abs=0.1)
