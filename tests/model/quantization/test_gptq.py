"""GPTQ checkpoints (4-bit sym, 4-bit asym with act-order, 8-bit) on the CPU against
Transformers on their dequantized weights, in one process and split over two ranks."""

from __future__ import annotations

import pytest

from tests.model.quantization.int_checkpoints import Scheme, write_int_pair
from tests.model.quantization.int_checks import check_against_transformers, check_two_ranks

SCHEMES = {
    "4bit-sym-g128": Scheme("gptq", 4, 128, sym=True),
    "4bit-asym-act-order-g32": Scheme("gptq", 4, 32, sym=False, desc_act=True),
    "8bit-sym-g64-v2": Scheme("gptq", 8, 64, sym=True, version="gptq_v2"),
}


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_gptq_greedy_equals_transformers_on_dequantized(float_source, tmp_path, name):
    scheme = SCHEMES[name]
    q_dir, float_dir = write_int_pair(float_source("llama2-bias"), tmp_path, scheme, name)
    check_against_transformers(q_dir, float_dir, scheme)


def test_gptq_act_order_split_over_two_ranks(float_source, tmp_path):
    """Act-order on a row-parallel layer: each rank takes its input rows and their g_idx and
    keeps every group's scales and zeros."""
    scheme = SCHEMES["4bit-asym-act-order-g32"]
    q_dir, float_dir = write_int_pair(float_source("llama2-bias"), tmp_path, scheme, "gptq")
    check_two_ranks(q_dir, float_dir)
