"""Draft-token proposers for speculative decoding (DESIGN.md: the proposer writes
`request.spec_token_ids`; the scheduler schedules them; the rejection sampler verifies them)."""

from inferengine.config import SpeculativeConfig
from inferengine.spec_decode.base import TokenProposer


def make_token_proposer(config: SpeculativeConfig | None) -> TokenProposer | None:
    """The engine core's proposer for `config`; None when drafts come from a model (in the
    worker) or when nothing speculates."""
    if config is None or config.method == "draft_model":
        return None
    if config.method == "suffix":
        from inferengine.spec_decode.suffix import SuffixProposer

        return SuffixProposer(config)
    from inferengine.spec_decode.ngram import NgramProposer

    return NgramProposer(config)
