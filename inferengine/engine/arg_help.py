"""The help text of each engine flag (`EngineArgs` field), as `--help` shows it."""

ENGINE_HELP = {
    "model": "model: an alias (smollm2-135m-instruct), a local folder, a .gguf file or a hub id",
    "tokenizer": "tokenizer folder or hub id (default: the model's)",
    "revision": "the hub commit, branch or tag of a hub-id model (not for local models)",
    "dtype": "weights and activations dtype; auto = bfloat16 on CUDA and, for quantized GGUF "
    "models, on a CPU with native bf16 (AVX512-BF16/AMX); float32 otherwise",
    "max_model_len": "longest prompt + output, in tokens (default: the model's context length)",
    "max_num_seqs": "most requests in one step",
    "max_num_batched_tokens": "token budget of one step (prefill chunks + decodes) (default: "
    "8192 on CUDA, 2048 on the CPU)",
    "enable_prefix_caching": "reuse the KV pages of shared prompt prefixes",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache "
    "(CUDA only)",
    "kv_cache_memory": "bytes for the KV cache, e.g. 2GiB (default on CPU: max_num_seqs requests "
    "of max_model_len plus a quarter for cached prefixes, within 0.3 of the memory available "
    "after loading the weights and leaving at least 1GiB; pages take memory once written)",
    "block_size": "tokens per KV page",
    "kv_cache_dtype": "KV cache storage: auto (the model's dtype), or fp8 (= fp8_e4m3) / "
    "fp8_e5m2: one byte per element, twice the tokens in the same memory, scaled by the "
    "checkpoint's k_scale/v_scale (1.0 without them)",
    "seed": "seed for weights (dummy), and for requests without their own seed",
    "generation_config": "defaults for the sampling fields a request leaves unset (temperature, "
    "top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens): auto = the "
    "model folder's generation_config.json; vllm = ignore it (temperature 1.0, top_p 1.0, ...); "
    "or a folder whose generation_config.json to take them from. The default model's folder "
    "asks for greedy decoding (temperature 0)",
    "load_format": "weights: auto (safetensors or GGUF), or dummy (random, for benchmarks)",
    "quantization": "fp8: FP8 weights (one scale per output channel, quantized on load from a "
    "bf16/fp16 checkpoint) and FP8 activations per token; FP8 checkpoints (Hugging Face fp8, "
    "compressed-tensors) and int4/int8 checkpoints (AWQ, GPTQ, compressed-tensors "
    "pack-quantized) are detected without it. none (default): unquantized",
    "gguf_dequantize": "load a GGUF's Q4_0/Q4_1/Q4_K/Q8_0/Q5_0 weights dequantized to --dtype; by "
    "default they stay quantized on the CPU, run by our C++ kernels",
    "model_impl": "auto: our own model code when the architecture has it, else Transformers' "
    "modeling code on our paged attention; native: ours only; transformers: always Transformers'",
    "device": "auto, cuda or cpu",
    "attention_backend": "attention implementation (auto: triton on CUDA, cpu on the CPU; torch: "
    "the plain reference)",
    "attention_backend_benchmark": "with --attention-backend auto: time the usable backends on "
    "the model's shape at start-up and keep the fastest (remembered per device and shape)",
    "enforce_eager": "no CUDA graphs",
    "long_prefill_token_threshold": "cap on one request's prefill chunk per step (0: none)",
    "scheduling_policy": "fcfs, or priority (lower `priority` value first)",
    "tensor_parallel_size": "ranks (GPUs, or CPU processes) that split each layer; one "
    "process each (NCCL on GPU, gloo on CPU)",
    "pipeline_parallel_size": "pipeline stages, each running a share of the layers on its own "
    "ranks (combines with --tensor-parallel-size)",
    "data_parallel_size": "serve only: engine replicas (each with its own engine core, split by "
    "the two sizes above) placed by Ray behind one endpoint, with a cache-aware router",
    "distributed_executor_backend": "how an engine of several ranks runs them: mp (worker "
    "processes on this machine) or ray (Ray actors in a placement group, which may span the "
    "nodes of a cluster; see --ray-address)",
    "ray_address": "with --data-parallel-size or --distributed-executor-backend ray: the Ray "
    "cluster to join (e.g. auto, or HEAD:6379), so replicas or ranks span its nodes; default: "
    "RAY_ADDRESS if set, else a local Ray started on demand",
    "router_policy": "with --data-parallel-size: how the router picks a replica. cache-aware "
    "(default): the least cost = uncached prompt tokens + the inflight weight x requests in "
    "flight + the KV usage weight x KV cache usage (0-1); round-robin: the replicas in turn. "
    "Both keep a prompt_cache_key session on its replica",
    "router_inflight_weight": "with --data-parallel-size and the cache-aware policy: what one "
    "request in flight on a replica costs, in prompt tokens to compute (default 16; 0 or more)",
    "router_kv_usage_weight": "with --data-parallel-size and the cache-aware policy: what a "
    "full KV cache costs, scaled by its usage, in prompt tokens (default 64; 0 or more)",
    "router_cpu_hit_weight": "with --data-parallel-size and --kv-offloading-size: what a prompt "
    "token found only in a replica's CPU tier costs, as a fraction of one to compute (default "
    "0.25; 0 to 1)",
    "kv_offloading_size": "GiB of host memory for a CPU tier of the KV cache (summed over "
    "ranks): pages evicted from the GPU are kept there and loaded back on a prefix hit",
    "num_gpu_blocks_override": "KV pages to allocate instead of the measured number (testing)",
    "max_waiting_requests": "serve only: requests that may wait beyond --max-num-seqs before "
    "new ones get 503 (default: unbounded)",
    "served_model_name": "the model name clients send and see (default: --model)",
    "speculative_config": 'speculative decoding as JSON, e.g. \'{"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}\'',
    "kv_transfer_config": "disaggregated prefill/decode as JSON, in vLLM's spelling, e.g. "
    '\'{"kv_role": "kv_producer", "kv_connector": "NixlConnector"}\' (kv_role: kv_producer, '
    "kv_consumer or kv_both; kv_connector: NixlConnector or SharedMemoryConnector, left out: "
    "the best that loads; kv_hold_timeout_s, kv_load_timeout_s, kv_ip, kv_port, engine_id, "
    "kv_buffer_dir); see docs/disaggregated.md",
    "async_scheduling": "schedule the next step while the GPU runs this one",
    "enable_lora": "serve LoRA adapters (PEFT folders) over the base model, many in one batch; "
    "see docs/lora.md",
    "max_loras": "LoRA adapters that may run in one step (device slots)",
    "max_lora_rank": "the largest adapter rank accepted (1 to 256); slots are this wide",
    "max_cpu_loras": "adapters kept loaded in host memory (default: --max-loras)",
    "enable_runtime_lora": "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter "
    "(vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    "warmup": "before /health answers, run once every step shape and sampler path that CUDA-graph "
    "capture leaves cold (prefill chunks above the graph sizes, long contexts, top-p/penalties/"
    "logprobs/grammar sampling), on the null KV page; the start-up log says what and how long "
    "(default: on with CUDA, off on the CPU)",
    "runner": "auto (pooling when the folder has Sentence-Transformers modules.json or its "
    "architecture is a *Model / *ForSequenceClassification one), generate, or pooling "
    "(/v1/embeddings, /v1/score, /v1/rerank; LLM.embed, LLM.score); see docs/embeddings.md",
    "convert": "auto, none, embed (run a decoder as an embedding model), or classify (a decoder "
    "as a yes/no reranker: P(yes) from classifier_from_token, default no/yes)",
}
