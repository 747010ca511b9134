"""AWQ (GEMM packing) checkpoints on the CPU against Transformers on their dequantized weights,
in one process and split over two ranks."""

from __future__ import annotations

import pytest

from tests.model.quantization.int_checkpoints import Scheme, write_int_pair
from tests.model.quantization.int_checks import check_against_transformers, check_two_ranks


@pytest.mark.parametrize("group_size", [128, 32])
def test_awq_greedy_equals_transformers_on_dequantized(float_source, tmp_path, group_size):
    scheme = Scheme("awq", 4, group_size)
    q_dir, float_dir = write_int_pair(float_source("qwen2"), tmp_path, scheme, "awq")
    check_against_transformers(q_dir, float_dir, scheme)


def test_awq_split_over_two_ranks(float_source, tmp_path):
    """Each rank takes its packed output columns (qkv, gate_up) or its input rows and their
    groups (o, down)."""
    q_dir, float_dir = write_int_pair(float_source("qwen2"), tmp_path, Scheme("awq", 4, 32), "awq")
    check_two_ranks(q_dir, float_dir)
