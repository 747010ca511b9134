"""`LLM`: offline batch generation, shaped like vLLM's `LLM` so code can switch over unchanged."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Sequence
from typing import Any

from inferengine.engine.arg_utils import DEFAULT_MODEL, EngineArgs
from inferengine.engine.input_processor import PromptType
from inferengine.engine.kv_transfer import KVBundle, export_prefix, import_prefix
from inferengine.engine.llm_engine import LLMEngine
from inferengine.entrypoints.cache_breakpoints import cache_breakpoints, take_cache_control
from inferengine.entrypoints.chat_messages import template_messages, templated_prompt
from inferengine.entrypoints.pooling_inputs import cosine, first_float, pair_ids, pair_up
from inferengine.errors import InvalidRequestError
from inferengine.lora.request import LoRARequest
from inferengine.outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from inferengine.pooling_params import (
    PoolingParams,
    check_task,
    pooling_sampling_params,
    resolve_pooling,
)
from inferengine.retention import Retention
from inferengine.sampling_params import RequestOutputKind, SamplingParams, sampling_defaults

Conversation = list[dict[str, Any]]


class LLM:
    """Generate from many prompts at once with continuous batching.

    >>> llm = LLM()  # the default model, smollm2-135m-instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
        **kwargs: Any,
    ):
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
            **kwargs,
        )
        self.engine_args = args
        self.llm_engine = LLMEngine(args.create_engine_config())
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no `sampling_params`: the model's
        generation_config.json values (`generation_config="auto"`, the default) over
        `SamplingParams()`'s, as in vLLM."""
        return SamplingParams(
            **sampling_defaults(self.llm_engine.config.model_config.generation_config)
        )

    def export_kv(self, prompt_token_ids: list[int], cache_salt: str | None = None) -> KVBundle:
        """The KV pages of the longest cached prefix of `prompt_token_ids` (full pages, from
        the GPU pool or the CPU tier), for another engine's `import_kv`."""
        return export_prefix(self.llm_engine.core, prompt_token_ids, cache_salt)

    def import_kv(self, bundle: KVBundle) -> int:
        """Put exported pages into this engine's CPU tier (`kv_offloading_size`), where a
        prompt with that prefix loads them; returns how many pages were new here."""
        return import_prefix(self.llm_engine.core, bundle)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        *,
        prompt_cache_key: str | None = None,
        prompt_cache_retention: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in the order given.

        `prompt_cache_key` names the session and `prompt_cache_retention` ("in_memory", or a
        duration such as "1h") says how long every prompt's KV pages outlive the call.
        """
        retention = Retention.parse(prompt_cache_key, prompt_cache_retention)
        prompt_list = _as_prompt_list(prompts)
        params_list = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise InvalidRequestError("priority must have one entry per prompt.")
        retentions = [retention] * len(prompt_list)
        loras = _as_lora_list(lora_request, len(prompt_list))
        return self._run(prompt_list, params_list, use_tqdm, priority, retentions, loras=loras)

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, pooled as the model's pooling says (docs/embeddings.md);
        `truncate_prompt_tokens` keeps the last k tokens of a longer prompt (-1: the model's
        maximum)."""
        check_task(self.llm_engine.config.model_config.pooler, "embed")
        prompt_list = _as_prompt_list(prompts)
        if truncate_prompt_tokens is not None:
            prompt_list = [self._truncated(p, truncate_prompt_tokens) for p in prompt_list]
        pooling = [pooling_params or PoolingParams() for _ in prompt_list]
        params = [pooling_sampling_params() for _ in prompt_list]
        outputs = self._run(
            prompt_list, params, use_tqdm, None, [Retention()] * len(params), pooling
        )
        return [
            EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, EmbeddingOutput(o.embedding))
            for o in outputs
        ]

    def score(
        self,
        data_1: str | list[str],
        data_2: str | list[str],
        use_tqdm: bool = True,
        *,
        truncate_prompt_tokens: int | None = None,
    ) -> list[ScoringRequestOutput]:
        """One score per (query, document) pair, as vLLM pairs them (one query against each
        document, or pairwise): a reranker's P(yes) (--convert classify), or the cosine of an
        embedding model's vectors."""
        pooler = self.llm_engine.config.model_config.pooler
        resolve_pooling(pooler, PoolingParams())  # a generating model is refused here
        assert pooler is not None
        pairs = pair_up(data_1, data_2)
        keep = truncate_prompt_tokens
        if pooler.task == "classify":
            tok = self.get_tokenizer()
            prompts = [pair_ids(tok, q, d, pooler.bidirectional) for q, d in pairs]
            if keep is not None:
                prompts = [self._truncated(p, keep) for p in prompts]
            outs = self._pool(prompts, PoolingParams(), use_tqdm)
            return [
                ScoringRequestOutput(o.request_id, ScoringOutput(first_float(o.pooled)))
                for o in outs
            ]
        texts = list(dict.fromkeys(t for pair in pairs for t in pair))
        prompts = [self._truncated(t, keep) if keep is not None else t for t in texts]
        vectors = {
            t: o.pooled
            for t, o in zip(texts, self._pool(prompts, PoolingParams(), use_tqdm), strict=True)
        }
        return [
            ScoringRequestOutput(str(i), ScoringOutput(cosine(vectors[q], vectors[d])))
            for i, (q, d) in enumerate(pairs)
        ]

    def _pool(
        self, prompts: list[Any], params: PoolingParams, use_tqdm: bool
    ) -> list[RequestOutput]:
        n = len(prompts)
        sampling = [pooling_sampling_params() for _ in prompts]
        return self._run(prompts, sampling, use_tqdm, None, [Retention()] * n, [params] * n)

    def _truncated(self, prompt: PromptType, keep: int) -> list[int]:
        max_len = self.llm_engine.config.model_config.max_model_len
        keep = max_len if keep == -1 else keep
        if not 1 <= keep <= max_len:
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or 1 to {max_len}; got {keep}.",
                param="truncate_prompt_tokens",
            )
        return self.llm_engine.input_processor.tokenize(prompt)[1][-keep:]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        *,
        prompt_cache_key: str | None = None,
        prompt_cache_retention: str | None = None,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Generate replies to conversations, each formatted with the model's chat template.

        The session arguments are `generate`'s. A message (or one of its content parts) with
        Anthropic's `"cache_control": {"type": "ephemeral", "ttl": "5m" | "1h"}` leases the
        prompt prefix that ends with it. `tools=[...]` (and other keyword arguments) go to the
        template; messages may be shaped as OpenAI's API sends them (null content beside
        `tool_calls`, whose arguments are JSON text; content as text parts): the template gets
        them as the server hands them over (`entrypoints/chat_messages.py`), as vLLM does.
        """
        retention = Retention.parse(prompt_cache_key, prompt_cache_retention)
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.llm_engine.input_processor
        kwargs = dict(
            template_kwargs,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
        )
        prompts: list[PromptType] = []
        retentions = []
        for conv in conversations:
            conv, leases = take_cache_control(conv)  # copies: the caller's stay as given
            conv = template_messages(conv)  # images and the like: a clear error
            prompt = templated_prompt(processor, conv, **kwargs)
            prompts.append(prompt)
            breakpoints = cache_breakpoints(
                processor, conv, leases, prompt["prompt_token_ids"], kwargs
            )
            retentions.append(dataclasses.replace(retention, breakpoints=tuple(breakpoints)))
        params_list = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params_list, use_tqdm, None, retentions)

    def _params_list(
        self, params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if params is None:
            return [self.get_default_sampling_params() for _ in range(n)]
        return _as_params_list(params, n)

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        use_tqdm: bool,
        priority: list[int] | None,
        retentions: list[Retention],
        pooling: list[PoolingParams] | None = None,
        loras: list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        # Tokenize and check everything first, so a bad prompt fails before any request starts.
        prepared = []
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            text, token_ids = engine.input_processor.tokenize(prompt)
            engine.input_processor.validate(token_ids, p, priority[i] if priority else 0)
            resolve_pooling(engine.config.model_config.pooler, pooling[i] if pooling else None)
            prepared.append({"prompt": text, "prompt_token_ids": token_ids})
        request_ids = []
        for i, (prompt, p) in enumerate(zip(prepared, params, strict=True)):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            request_id = str(next(self._ids))
            engine.add_request(
                request_id,
                prompt,
                p,
                priority=priority[i] if priority else 0,
                retention=retentions[i],
                lora_request=loras[i] if loras else None,
                pooling_params=pooling[i] if pooling else None,
            )
            request_ids.append(request_id)
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(prompts)) if use_tqdm and len(prompts) > 1 else None
        start, num_out = time.perf_counter(), 0
        try:
            while len(results) < len(request_ids):
                for output in engine.step():
                    if output.finished:
                        results[output.request_id] = output
                        num_out += sum(len(c.token_ids) for c in output.outputs)
                        if bar is not None:
                            rate = num_out / max(time.perf_counter() - start, 1e-9)
                            bar.set_postfix_str(f"{rate:.1f} output tok/s", refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in request_ids]


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)


def _as_lora_list(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int
) -> list[LoRARequest | None] | None:
    """One adapter (or None) per prompt: one for all, or a list matching the prompts."""
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n if lora is not None else None
    loras = list(lora)
    if len(loras) != n:
        raise InvalidRequestError(
            f"got {len(loras)} LoRA requests for {n} prompts; give one, or one per prompt."
        )
    return loras


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts


def _as_params_list(
    params: SamplingParams | Sequence[SamplingParams], n: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise InvalidRequestError(
            f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt."
        )
    return params
