"""`Worker`: one device: sets it up, loads the model, sizes and allocates the KV cache, runs steps."""

from __future__ import annotations

import time

import torch

from inferengine.attention.autotune import AttentionShape
from inferengine.attention.selector import select_attention_backend
from inferengine.config import EngineConfig, ModelConfig
from inferengine.core.sched_output import ModelRunnerOutput, SchedulerOutput
from inferengine.logger import init_logger
from inferengine.model.loader.loader import TORCH_DTYPES, load_model
from inferengine.spec_decode.draft_model import DraftModelProposer
from inferengine.worker import kv_memory
from inferengine.worker.cpu_env import configure_threads
from inferengine.worker.cuda_graphs import default_capture_sizes, default_mixed_sizes
from inferengine.worker.kv_connector import KVConnectorWorker
from inferengine.worker.kv_offload import HostKVTier
from inferengine.worker.lora_slots import LoRASlots
from inferengine.worker.model_runner import ModelRunner
from inferengine.worker.profile_run import profile_run
from inferengine.worker.warm_up import warm_up

logger = init_logger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, device_index: int | None = None):
        """`device_index`: the CUDA device of this rank where it is not `rank` (a Ray actor
        sees only its node's GPUs)."""
        self.config = config
        self.rank = rank
        if config.device == "cuda":
            self.device = torch.device("cuda", rank if device_index is None else device_index)
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            configure_threads(config.parallel_config.world_size)
        torch.manual_seed(config.model_config.seed)
        self.dtype = TORCH_DTYPES[config.model_config.dtype]
        self.kv_dtype = kv_memory.kv_cache_dtype(config)
        self.attn_backend, self.attn_timings_ms = select_attention_backend(
            config.attention_backend,
            config.attention_backend_benchmark,
            self.device,
            self.attention_shape(),
        )
        logger.info("attention backend: %s", self.attn_backend.name)
        model = load_model(config.model_config, self.device, self.attn_backend)
        self.runner = ModelRunner(config, model, self.device)
        if config.lora_config is not None:
            self.runner.lora = LoRASlots(config, model, self.device, self.runner.requests)
        spec = config.speculative_config
        self.draft_config = spec.draft_model_config if spec is not None else None
        if self.draft_config is not None:
            self.runner.drafter = self._load_draft_model(self.draft_config)

    def _load_draft_model(self, draft: ModelConfig) -> DraftModelProposer:
        backend, _ = select_attention_backend(
            self.config.attention_backend,
            False,
            self.device,
            self.attention_shape(draft),
        )
        logger.info("draft model %s, attention backend %s", draft.model, backend.name)
        model = load_model(draft, self.device, backend)
        return DraftModelProposer(model, self.config.cache_config.block_size, self.device)

    def attention_shape(self, model_config: ModelConfig | None = None) -> AttentionShape:
        m = model_config or self.config.model_config
        tp = self.config.parallel_config.tensor_parallel_size
        use_window = m.hf_config.get("use_sliding_window", True)
        return AttentionShape(
            num_heads=m.num_attention_heads // tp,
            num_kv_heads=max(1, m.num_kv_heads // tp),
            head_dim=m.head_dim,
            block_size=self.config.cache_config.block_size,
            dtype=self.dtype,
            kv_cache_dtype=self.kv_dtype,
            sliding_window=m.hf_config.get("sliding_window") if use_window else None,
        )

    def determine_num_blocks(self) -> int:
        if self.device.type == "cuda":
            start = time.perf_counter()
            n = kv_memory.num_blocks_for_cuda(
                self.config, self.kv_dtype, self.device, lambda: profile_run(self.runner)
            )
            logger.info("memory profiling took %.2f s", time.perf_counter() - start)
        else:
            n = kv_memory.num_blocks_for_cpu(self.config, self.kv_dtype)
        override = self.config.cache_config.num_gpu_blocks_override
        return override if override else n

    def determine_num_host_blocks(self) -> tuple[int, int]:
        """Pages of the CPU tier this rank's share of --kv-offloading-size holds, and the
        bytes of one of its pages."""
        gib = self.config.cache_config.kv_offloading_size or 0.0
        page_bytes = kv_memory.kv_block_bytes(self.config, self.kv_dtype)
        share = gib * 2**30 / self.config.parallel_config.world_size
        return int(share // page_bytes), page_bytes

    def initialize_cache(self, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.runner.kv_caches = kv_memory.allocate_kv_caches(
            self.config, num_blocks, self.kv_dtype, self.device
        )
        if num_host_blocks:
            self.runner.host_tier = HostKVTier(self.runner.kv_caches, num_host_blocks)
        if self.config.kv_transfer_config is not None:
            self.runner.kv_connector = KVConnectorWorker(
                self.config.kv_transfer_config,
                self.runner.kv_caches,
                self.config.cache_config.block_size,
            )
        if self.runner.drafter is not None:
            self.runner.drafter.kv_caches = kv_memory.allocate_kv_caches(
                self.config, num_blocks, self.kv_dtype, self.device, self.draft_config
            )
        # Backends that read lengths on the host (torch, flex) cannot be captured; with
        # --enforce-eager, decode steps keep the padded shapes but run eagerly. Pipeline
        # stages run eagerly and unpadded.
        staged = self.config.parallel_config.pipeline_parallel_size > 1
        if self.device.type == "cuda" and self.attn_backend.cuda_graph_safe and not staged:
            sc = self.config.scheduler_config
            sizes = self.config.cuda_graph_sizes or default_capture_sizes(
                sc.max_num_seqs, sc.max_num_batched_tokens
            )
            self.runner.capture_cuda_graphs(
                sizes,
                default_mixed_sizes(sc.max_num_batched_tokens),
                capture=not self.config.enforce_eager,
            )
        if self.config.warmup:
            warm_up(self.runner)
        # Profiling, capture and warm-up ran the model: start the expert counts from zero.
        reset = getattr(self.runner.model, "reset_expert_token_counts", None)
        if reset is not None:
            reset()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def expert_token_counts(self) -> dict[int, list[int]]:
        """Tokens routed to each expert, by layer, for a mixture-of-experts model (this
        rank's layers); empty for a dense model. Waits for the steps in flight."""
        counts = getattr(self.runner.model, "expert_token_counts", None)
        return counts() if counts is not None else {}
