"""Pooling requests' parameters (`PoolingParams`) and a pooling model's settings (`PoolerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from inferengine.errors import InvalidRequestError
from inferengine.sampling_params import RequestOutputKind, SamplingParams

POOLING_TYPES = ("LAST", "MEAN", "CLS")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("embed", "classify")


class PoolingParams(msgspec.Struct, omit_defaults=True):
    """How one prompt-only request pools its prompt's final hidden states into one vector.

    Users set `dimensions` (keep the leading components, Matryoshka) and `normalize` (scale
    to unit length, after the cut); what they leave None the API process fills from the
    model's `PoolerConfig` (`resolve_pooling`), as it does `pooling_type`: LAST (the last
    prompt token), MEAN (all prompt tokens) or CLS (the first).
    """

    dimensions: int | None = None
    normalize: bool | None = None
    pooling_type: str | None = None
    # classify (yes/no rerankers): the vector is [P(second)], the softmax over the LM head's
    # logits of these two tokens at the last prompt token
    score_token_ids: list[int] | None = None
    # an encoder's prompt: attended bidirectionally, so run whole in one step, with no hits
    bidirectional: bool = False
    # classify with the model's own head (a cross-encoder): [sigmoid(logit)] of the CLS row
    score_head: bool = False

    @property
    def needs_every_token(self) -> bool:
        """MEAN and CLS read positions a prefix-cache hit would skip: such requests take none."""
        return self.bidirectional or self.pooling_type not in (None, "LAST")


@dataclass(frozen=True)
class PoolerConfig:
    """A pooling model's pooling, from its Sentence-Transformers files or the defaults."""

    pooling_type: str = "LAST"
    normalize: bool = True
    task: str = "embed"  # embed (vectors) or classify (a yes/no score per prompt)
    score_token_ids: tuple[int, int] | None = None  # classify: the (no, yes) token ids
    bidirectional: bool = False  # an encoder (BERT, XLM-RoBERTa)
    max_positions: int = 0  # an encoder's prompt limit (its position table)
    # Matryoshka: the widths the model was trained to be cut to (None: any up to hidden_size)
    matryoshka_dimensions: tuple[int, ...] | None = None
    hidden_size: int = 0
    source: str = "default"  # where the settings came from, for logs


def pooling_sampling_params() -> SamplingParams:
    """The sampling side of a pooling request: its one token is drawn greedily and dropped;
    max_tokens 1 ends it after its prefill (the scheduler never schedules it a decode)."""
    return SamplingParams(
        max_tokens=1, temperature=0.0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY
    )


def resolve_pooling(
    pooler: PoolerConfig | None, params: PoolingParams | None
) -> PoolingParams | None:
    """`params` completed from the model's pooling. A pooling request needs a pooling model,
    a generation request a generating one; the cut `dimensions` must be one the model serves."""
    if params is None:
        if pooler is not None:
            raise InvalidRequestError(
                "this model runs as a pooling (embedding) model: it serves /v1/embeddings "
                "(LLM.embed), not generation. Start a generating model for completions."
            )
        return None
    if pooler is None:
        raise InvalidRequestError(
            "this model generates text; embeddings need a pooling model (start it with "
            "--runner pooling, or serve an embedding checkpoint)."
        )
    dims = params.dimensions
    if pooler.task == "classify":
        if dims is not None or params.normalize:
            raise InvalidRequestError(
                "this model scores (--convert classify): dimensions and normalize do not apply.",
                param="dimensions" if dims is not None else "normalize",
            )
        ids = list(pooler.score_token_ids) if pooler.score_token_ids else None
        return PoolingParams(
            normalize=False,
            pooling_type=pooler.pooling_type,
            score_token_ids=ids,
            score_head=ids is None,
            bidirectional=pooler.bidirectional,
        )
    if params.pooling_type is not None and params.pooling_type != pooler.pooling_type:
        raise InvalidRequestError(
            f"this model pools {pooler.pooling_type}; a request cannot change it.",
            param="pooling_type",
        )
    full = PoolingParams(
        dimensions=dims,
        normalize=pooler.normalize if params.normalize is None else params.normalize,
        pooling_type=pooler.pooling_type,
        bidirectional=pooler.bidirectional,
    )
    if dims is None:
        return full
    if not 1 <= dims <= pooler.hidden_size:
        raise InvalidRequestError(
            f"dimensions {dims} is outside [1, {pooler.hidden_size}] (the model's hidden size).",
            param="dimensions",
        )
    allowed = pooler.matryoshka_dimensions
    if allowed is not None and dims not in allowed:
        raise InvalidRequestError(
            f"dimensions {dims} is not one this model was trained for: {list(allowed)}.",
            param="dimensions",
        )
    return full


def check_task(pooler: PoolerConfig | None, task: str) -> None:
    """Embeddings need an embedding model; yes/no scores a classify (reranker) one."""
    if pooler is None or pooler.task == task:
        return  # a generating model is refused per request, by resolve_pooling
    if task == "embed":
        raise InvalidRequestError(
            "this model scores pairs (--convert classify): use /v1/score or /v1/rerank "
            "(LLM.score), not embeddings."
        )
    raise InvalidRequestError(f"this model serves {pooler.task}, not {task}.")
