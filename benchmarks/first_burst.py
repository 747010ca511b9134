"""One-time costs after start-up: how long do the first bursts of new prompts take to reach
their first token, and what compiles or allocates on the way?

Starts the engine as the W1 paired run serves it (dummy weights, --max-model-len 2048), warms
it up as `bench serve --num-warmups 16` does (one prompt sent 16 times), then sends bursts of
16 different random prompts (128-384 tokens, one output token each) one after another. For
each burst it records the wall time, the Triton kernels compiled during it and the growth of
the CUDA caching allocator. A first burst much slower than the later ones is a cost the
start-up warm-up should have paid. Writes `benchmarks/results/<UTC stamp>-first-burst/`.

    python benchmarks/first_burst.py [--model configs/qwen2.5-7b] [--bursts 4] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from result_folder import write_result_folder

COMPILES: list[dict] = []
ALLOCATOR_EVENTS = ("num_alloc_retries", "num_device_alloc", "num_device_free")


def _record_compile(*args, **kwargs) -> bool:
    """Triton's JIT cache hook: called before each kernel variant is compiled (or loaded
    from the disk cache); returning False lets the compile go on."""
    fn = kwargs.get("fn")
    name = getattr(getattr(fn, "jit_function", fn), "__name__", None) or str(fn)
    COMPILES.append({"kernel": name, "t": time.perf_counter(), "key": str(kwargs.get("key"))[:300]})
    return False


class Probe:
    """Wraps the engine's step and the executor's launch to time them, and collects the
    host syncs torch reports while `sync_debug` is on."""

    def __init__(self, llm, sync_debug: bool):
        self.llm = llm
        self.sync_debug = sync_debug and torch.cuda.is_available()
        self.steps: list[float] = []
        self.launches: list[float] = []
        self.syncs: list[str] = []
        llm.llm_engine.step = self._timed(llm.llm_engine.step, self.steps)
        executor = llm.llm_engine.core.executor
        executor.execute_model_async = self._timed(executor.execute_model_async, self.launches)
        if self.sync_debug:
            warnings.showwarning = self._record_sync
            warnings.simplefilter("always")

    @staticmethod
    def _timed(fn, into: list[float]):
        def timed(*args):
            start = time.perf_counter()
            out = fn(*args)
            into.append((time.perf_counter() - start) * 1e3)
            return out

        return timed

    def _record_sync(self, message, category, filename, lineno, file=None, line=None):
        where = [f for f in traceback.format_stack()[:-1] if "inferengine" in f]
        self.syncs.append(f"{message}\n" + "".join(where[-4:]))

    def run(self, batch: list[dict], max_tokens: int) -> dict:
        """Generate for `batch` and report what happened on the way."""
        from inferengine import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
        stats = torch.cuda.memory_stats() if cuda else {}
        reserved = torch.cuda.memory_reserved() if cuda else 0
        for kept in (self.steps, self.launches, self.syncs):
            kept.clear()
        first_compile = len(COMPILES)
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode("warn")
        start = time.perf_counter()
        self.llm.generate(batch, params, use_tqdm=False)
        wall = time.perf_counter() - start
        if self.sync_debug:
            torch.cuda.set_sync_debug_mode(0)
        after = torch.cuda.memory_stats() if cuda else {}
        compiled = COMPILES[first_compile:]
        return {
            "prompt_tokens": sum(len(p["prompt_token_ids"]) for p in batch),
            "wall_ms": wall * 1e3,
            "compiles": [
                {"kernel": c["kernel"], "at_ms": (c["t"] - start) * 1e3} for c in compiled
            ],
            "compile_keys": [c["key"] for c in compiled],
            "engine_steps_ms": list(self.steps),
            "launch_ms": list(self.launches),
            "allocator_events": {k: after.get(k, 0) - stats.get(k, 0) for k in ALLOCATOR_EVENTS},
            "host_syncs": sorted(set(self.syncs)),
            "reserved_growth_MiB": ((torch.cuda.memory_reserved() if cuda else 0) - reserved)
            / 2**20,
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="configs/qwen2.5-7b")
    parser.add_argument("--bursts", type=int, default=4)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--burst-size", type=int, default=16)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument(
        "--sync-debug", action="store_true",
        help="record where the bursts make the host wait for the GPU (torch sync debug mode)",
    )  # fmt: skip
    parser.add_argument(
        "--profile", action="store_true",
        help="profile the last burst: the host operations that took longest, in results.json",
    )  # fmt: skip
    args = parser.parse_args()

    from triton import knobs

    from inferengine import LLM

    t0 = time.perf_counter()
    llm = LLM(
        args.model, load_format="dummy", max_model_len=args.max_model_len,
        gpu_memory_utilization=0.82,
    )  # fmt: skip
    ready_s = time.perf_counter() - t0
    probe = Probe(llm, args.sync_debug)
    vocab = llm.llm_engine.core.config.model_config.vocab_size
    rng = random.Random(0)

    def prompts(n: int, same: bool = False) -> list[dict]:
        first = [rng.randrange(vocab) for _ in range(rng.randint(128, 384))]
        out = []
        for _ in range(n):
            ids = first if same else [rng.randrange(vocab) for _ in range(rng.randint(128, 384))]
            out.append({"prompt_token_ids": ids})
        return out

    knobs.runtime.jit_cache_hook = _record_compile
    results: dict = {"model": args.model, "ready_s": ready_s, "warmup": None, "bursts": []}
    results["warmup"] = probe.run(prompts(args.burst_size, same=True), 64)
    print(f"warm-up: {results['warmup']['wall_ms']:.1f} ms", flush=True)
    for i in range(args.bursts):
        batch = prompts(args.burst_size)
        if args.profile and i == args.bursts - 1:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                burst = probe.run(batch, 1)
            table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            results["profile_host_ops"] = table
            print(table, flush=True)
        else:
            burst = probe.run(batch, 1)
        results["bursts"].append(burst)
        kernels = sorted({c["kernel"] for c in burst["compiles"]})
        print(
            f"burst {i}: {burst['prompt_tokens']} tokens, {burst['wall_ms']:.1f} ms, "
            f"steps {[round(x, 1) for x in burst['engine_steps_ms']]} ms, launches "
            f"{[round(x, 1) for x in burst['launch_ms']]} ms, {burst['allocator_events']}, "
            f"{len(burst['host_syncs'])} sync sites, compiled {kernels}, "
            f"allocator +{burst['reserved_growth_MiB']:.0f} MiB",
            flush=True,
        )
        for site in burst["host_syncs"][:4]:
            print("  sync:", site, flush=True)
    knobs.runtime.jit_cache_hook = None
    folder = write_result_folder("first-burst", results, args.out_dir)
    print(f"results: {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
