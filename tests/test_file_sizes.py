"""No module of the package grows past 500 lines ([21]): a file that does is split along its
seams (as engine/arg_checks.py came out of arg_utils.py), not allowed to drift."""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "inferengine"
LIMIT = 500


def test_no_module_is_longer_than_500_lines():
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > LIMIT
    }
    assert not long, f"split these modules (lines over {LIMIT}): {long}"
