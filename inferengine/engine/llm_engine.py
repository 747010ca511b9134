"""`LLMEngine`: the synchronous engine behind `LLM`: prompts in, `RequestOutput`s out.

Input processing and output processing happen here; the engine core (in this process) sees
token ids only.
"""

from __future__ import annotations

from typing import Any

from inferengine.config import EngineConfig
from inferengine.core.engine_io import EngineCoreRequest
from inferengine.engine.core import EngineCore
from inferengine.engine.input_processor import InputProcessor, PromptType
from inferengine.engine.output_processor import OutputProcessor, ParentRequest
from inferengine.errors import ConfigError
from inferengine.lora.checker import adapter_checker
from inferengine.lora.request import LoRARequest
from inferengine.outputs import RequestOutput
from inferengine.pooling_params import PoolingParams
from inferengine.retention import Retention
from inferengine.sampling_params import SamplingParams
from inferengine.tokenizer import load_tokenizer


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The settings of sample `index` of an `n > 1` request: its own seed, n = 1."""
    child = params.clone()
    child.n = 1
    if params.seed is not None:
        child.seed = params.seed + index
    return child


def child_request_id(request_id: str, index: int) -> str:
    """The engine-core id of sample `index` of an `n > 1` request."""
    return f"{index}_{request_id}"


def fan_out(
    input_processor: InputProcessor,
    output_processor: OutputProcessor,
    request_id: str,
    text: str | None,
    token_ids: list[int],
    params: SamplingParams,
    priority: int = 0,
    cache_salt: str | None = None,
    retention: Retention | None = None,
    kv_transfer_params: dict | None = None,
    pooling_params: PoolingParams | None = None,
    lora_request: LoRARequest | None = None,
) -> list[EngineCoreRequest]:
    """The engine-core requests of one user request (one per sample of `n`), each validated
    before any is registered with the output processor; returns them to be sent."""
    parent = ParentRequest(request_id, params.n, params.output_kind) if params.n > 1 else None
    requests = [
        input_processor.make_request(
            child_request_id(request_id, index) if parent else request_id,
            token_ids,
            child_params(params, index) if parent else params,
            priority=priority,
            cache_salt=cache_salt,
            retention=retention,
            lora_request=lora_request,
            kv_transfer_params=kv_transfer_params,
            pooling_params=pooling_params,
        )
        for index in range(params.n)
    ]
    for index, request in enumerate(requests):
        output_processor.add_request(
            request.request_id,
            text,
            token_ids,
            request.sampling_params,
            request.arrival_time,
            parent,
            index,
        )
    return requests


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.scheduler_config.max_waiting_requests is not None:
            # Admission control answers HTTP clients with 503; offline, every request waits.
            raise ConfigError(
                "--max-waiting-requests applies to `inferengine serve` only; offline (LLM, "
                "generate, run-batch) every request waits its turn. Drop it (run-batch bounds "
                "its queue with --max-in-flight)."
            )
        if config.parallel_config.data_parallel_size > 1:
            raise ConfigError(
                "--data-parallel-size runs replicas behind the server only (`inferengine serve "
                "--data-parallel-size N`); offline (LLM, generate, run-batch) one engine runs "
                "in this process. Drop it, or run one LLM per replica yourself."
            )
        self.config = config
        self.tokenizer = load_tokenizer(
            config.model_config.tokenizer or config.model_config.model_path
        )
        self.input_processor = InputProcessor(
            config.model_config, self.tokenizer, config.scheduler_config.policy
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.input_processor.lora = adapter_checker(config)
        self.core = EngineCore(config)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        cache_salt: str | None = None,
        retention: Retention | None = None,
        kv_transfer_params: dict | None = None,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        text, token_ids = self.input_processor.tokenize(prompt)
        for request in fan_out(
            self.input_processor,
            self.output_processor,
            request_id,
            text,
            token_ids,
            params,
            priority,
            cache_salt,
            retention,
            kv_transfer_params,
            pooling_params,
            lora_request=lora_request,
        ):
            self.core.add_request(request)

    def abort_request(self, request_ids: list[str]) -> None:
        """Abort these requests; the id of an `n > 1` request aborts its samples."""
        core_ids = []
        for request_id in request_ids:
            parent = self.output_processor.parents.pop(request_id, None)
            if parent is None:
                core_ids.append(request_id)
            else:
                core_ids += [child_request_id(request_id, i) for i in range(parent.n)]
        self.output_processor.abort(core_ids)
        self.core.abort_requests(core_ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, to_abort = self.output_processor.process_outputs(
            core_outputs.outputs, core_outputs.errors
        )
        if to_abort:
            self.core.abort_requests(to_abort)
        self.last_stats = core_outputs.scheduler_stats
        return outputs

    def get_tokenizer(self) -> Any:
        return self.tokenizer
