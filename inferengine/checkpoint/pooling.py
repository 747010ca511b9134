"""Generate or pool: `--runner`/`--convert` and the checkpoint's files decide; a pooling
model's pooling comes from its Sentence-Transformers files (`modules.json`, `1_Pooling/`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from inferengine.errors import ConfigError
from inferengine.pooling_params import CONVERTS, RUNNERS, PoolerConfig

# Decoder architectures whose last hidden states we pool (our native classes).
HEADLESS = frozenset({"LlamaModel", "MistralModel", "Qwen2Model", "Qwen3Model"})
POOLING_ARCHITECTURES = HEADLESS | frozenset(
    {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}
)
# Encoders (model/bert.py): bidirectional attention; positions start after XLM-R's padding id.
ENCODER_ARCHITECTURES = frozenset({"BertModel", "XLMRobertaModel"})
CROSS_ENCODERS = frozenset({"XLMRobertaForSequenceClassification"})  # one-logit rerankers
# Pooling-only checkpoint architectures not built yet (other encoders, headless decoders).
_NOT_BUILT = ("Model", "ForSequenceClassification", "ForMaskedLM")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_BUILT = {"sentence_transformers.models.Transformer", _ST_POOLING, _ST_NORMALIZE}
_MODES = {
    "pooling_mode_lasttoken": "LAST",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
}
_MODES_NOT_BUILT = (
    "pooling_mode_max_tokens",
    "pooling_mode_mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens",
)


def resolve_pooler(
    model_path: str | Path, hf_config: dict[str, Any], runner: str = "auto", convert: str = "auto"
) -> PoolerConfig | None:
    """The model's `PoolerConfig` when it runs as a pooling model, None when it generates."""
    if runner not in RUNNERS:
        raise ConfigError(f"--runner must be one of {', '.join(RUNNERS)}; got {runner!r}.")
    if convert not in CONVERTS:
        raise ConfigError(f"--convert must be one of {', '.join(CONVERTS)}; got {convert!r}.")
    path = Path(model_path)
    arch = (hf_config.get("architectures") or ["?"])[0]
    modules = _st_modules(path)
    if runner == "generate":
        if convert in ("embed", "classify"):
            raise ConfigError(f"--convert {convert} needs --runner pooling (or auto).")
        if arch in HEADLESS | ENCODER_ARCHITECTURES | CROSS_ENCODERS:
            raise ConfigError(f"{arch} has no LM head to generate with: it runs --runner pooling.")
        return None
    pooling = runner == "pooling" or convert in ("embed", "classify")
    if runner == "auto" and not pooling:
        pooling = modules is not None or arch.endswith(_NOT_BUILT)
    if not pooling:
        return None
    if convert == "none":
        raise ConfigError("--convert none leaves no pooler: a pooling model needs --convert embed.")
    if convert == "classify" and arch in POOLING_ARCHITECTURES - HEADLESS:
        return _yes_no_scorer(path, hf_config)
    if arch in ENCODER_ARCHITECTURES or arch in CROSS_ENCODERS:
        return _encoder(path, modules, hf_config, arch)
    if arch not in POOLING_ARCHITECTURES:
        raise ConfigError(
            f"pooling runs decoders {sorted(POOLING_ARCHITECTURES)} and encoders "
            f"{sorted(ENCODER_ARCHITECTURES)}; {arch!r} is not built yet (classification "
            "heads and headless decoder *Model checkpoints among them)."
        )
    config = _from_sentence_transformers(path, modules) if modules is not None else {}
    dims = hf_config.get("matryoshka_dimensions")
    return PoolerConfig(
        pooling_type=config.get("pooling_type", "LAST"),
        normalize=config.get("normalize", True),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        hidden_size=int(hf_config["hidden_size"]),
        source="sentence-transformers" if modules is not None else "default",
    )


def _st_modules(path: Path) -> list[dict[str, Any]] | None:
    file = path / "modules.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text())


def _from_sentence_transformers(path: Path, modules: list[dict[str, Any]]) -> dict[str, Any]:
    """pooling_type and normalize from the modules; a module we do not run is refused."""
    types = [m.get("type", "") for m in modules]
    unknown = [t for t in types if t not in _ST_BUILT]
    if unknown:
        raise ConfigError(
            f"the model's modules.json lists {unknown[0]!r}; of Sentence-Transformers modules "
            "only Transformer, Pooling and Normalize are built (Dense projections are not)."
        )
    config: dict[str, Any] = {"normalize": _ST_NORMALIZE in types}
    for module in modules:
        if module.get("type") != _ST_POOLING:
            continue
        settings = json.loads((path / module.get("path", "") / "config.json").read_text())
        for key in _MODES_NOT_BUILT:
            if settings.get(key):
                raise ConfigError(f"Sentence-Transformers pooling {key} is not built yet.")
        if settings.get("include_prompt") is False:
            raise ConfigError(
                "Sentence-Transformers pooling with include_prompt false is not built."
            )
        chosen = [mode for key, mode in _MODES.items() if settings.get(key)]
        if len(chosen) != 1:
            raise ConfigError(
                f"the model's pooling config turns on {chosen or 'no mode'}; exactly one of "
                "last-token, mean or CLS pooling is built."
            )
        config["pooling_type"] = chosen[0]
    return config


def _yes_no_scorer(path: Path, hf_config: dict[str, Any]) -> PoolerConfig:
    """A decoder reranker scored by two of its LM head's tokens (Qwen3-Reranker: "no", "yes"),
    as vLLM's `classifier_from_token`; config.json may name others."""
    from inferengine.tokenizer import load_tokenizer

    tokens = hf_config.get("classifier_from_token") or ["no", "yes"]
    if len(tokens) != 2:
        raise ConfigError(
            f"classifier_from_token {tokens!r}: two tokens (no, yes) are built; other "
            "classification heads are not."
        )
    tokenizer = load_tokenizer(str(path))
    ids = [tokenizer.convert_tokens_to_ids(t) for t in tokens]
    unk = getattr(tokenizer, "unk_token_id", None)
    if any(i is None or i == unk for i in ids):
        raise ConfigError(f"classifier_from_token {tokens!r}: not single tokens of this tokenizer.")
    return PoolerConfig(
        pooling_type="LAST",
        normalize=False,
        task="classify",
        score_token_ids=(int(ids[0]), int(ids[1])),
        hidden_size=int(hf_config["hidden_size"]),
        source="classifier_from_token",
    )


def _encoder(
    path: Path, modules: list[dict[str, Any]] | None, hf_config: dict[str, Any], arch: str
) -> PoolerConfig:
    """An encoder embeds (CLS pooling unless its Sentence-Transformers files say otherwise)."""
    config = _from_sentence_transformers(path, modules) if modules is not None else {}
    offset = int(hf_config.get("pad_token_id", 1)) + 1 if arch.startswith("XLMRoberta") else 0
    cross = arch in CROSS_ENCODERS
    return PoolerConfig(
        pooling_type="CLS" if cross else config.get("pooling_type", "CLS"),
        normalize=False if cross else config.get("normalize", True),
        task="classify" if cross else "embed",
        hidden_size=int(hf_config["hidden_size"]),
        source="sentence-transformers" if modules is not None else "default",
        bidirectional=True,
        max_positions=int(hf_config["max_position_embeddings"]) - offset,
    )


def encoder_limits(
    pooler: PoolerConfig, max_model_len: int, budget: int, args: Any
) -> tuple[int, int]:
    """An encoder runs each prompt whole in one step: the step budget covers max_model_len,
    which stays within the position table (XLM-R's starts at padding_idx + 1)."""
    if max_model_len > pooler.max_positions:
        if args.max_model_len is not None:
            raise ConfigError(
                f"--max-model-len {max_model_len} is longer than this encoder's "
                f"{pooler.max_positions} positions."
            )
        max_model_len = pooler.max_positions
    if budget < max_model_len and args.max_num_batched_tokens is not None:
        raise ConfigError(
            f"an encoder runs each prompt in one step: --max-num-batched-tokens ({budget}) "
            f"must cover --max-model-len ({max_model_len})."
        )
    return max_model_len, max(budget, max_model_len)
