"""Peak memory while a model loads, unquantized and with `--quantization fp8`: does an FP8 load
peak near the FP8 model, or near the bf16 one?

Each case loads in a fresh process (`load_model`, as the worker does) and reports its peak:
on CUDA `torch.cuda.max_memory_allocated()` (and the host's peak RSS), on the CPU the process's
peak RSS (`ru_maxrss`) above what it held before the load, plus a sampled peak of its anonymous
RSS (file pages of the mapped checkpoint left out). Beside each peak: the loaded model's bytes
(parameters and buffers), so "peak ≈ the FP8 model" reads directly.

Sources, each unquantized and FP8:
- `dummy`: random weights at the real shape of `--config` (GPU default configs/qwen2.5-7b);
- `safetensors`: a bf16 checkpoint written first, in shards, at `--config`'s shape scaled down
  (`--scaled-*`; `--full-checkpoint`: at its own shape), loaded through the weight loaders
  (each tensor quantized as it loads).
On the CPU both use the scaled shape (default: Qwen2.5-7B at half width, 8 layers, 32k vocab:
1.2 GB of bf16). `--baseline-tree DIR` loads the same cases from another checkout as well (e.g.
the revision before quantization at construction), reported under "baseline".

    python benchmarks/load_peak.py --device cpu [--baseline-tree /tmp/ie-before]
    python benchmarks/load_peak.py --device cuda [--config configs/qwen2.5-7b]

Writes `benchmarks/results/<UTC stamp>-load-peak-<device>/` (`--out-root` for another root).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

REPO = Path(__file__).resolve().parent.parent
GIB = 1024**3


# ---- the checkpoint ---------------------------------------------------------------------------


def scaled_config(config: dict, args: argparse.Namespace) -> dict:
    """`config` at the scaled shape (head dim kept)."""
    c = dict(config)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    c.update(
        hidden_size=args.scaled_heads * head_dim,
        num_attention_heads=args.scaled_heads,
        num_key_value_heads=args.scaled_kv_heads,
        intermediate_size=args.scaled_intermediate,
        num_hidden_layers=args.scaled_layers,
        vocab_size=args.scaled_vocab,
        torch_dtype="bfloat16",
    )
    return c


def write_checkpoint(folder: Path, config: dict, shard_bytes: int) -> None:
    """A bf16 checkpoint of Qwen2/Llama names at `config`'s shape: small normal weights, norms
    1, written in shards of about `shard_bytes` with an index (run in its own process)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    h, inter = config["hidden_size"], config["intermediate_size"]
    head = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * head
    bias = config.get("model_type") == "qwen2"
    gen = torch.Generator().manual_seed(0)

    def tensors():
        yield "model.embed_tokens.weight", (config["vocab_size"], h)
        for i in range(config["num_hidden_layers"]):
            p = f"model.layers.{i}"
            for name, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv)):
                yield f"{p}.self_attn.{name}.weight", (rows, h)
                if bias:
                    yield f"{p}.self_attn.{name}.bias", (rows,)
            yield f"{p}.self_attn.o_proj.weight", (h, h)
            yield f"{p}.mlp.gate_proj.weight", (inter, h)
            yield f"{p}.mlp.up_proj.weight", (inter, h)
            yield f"{p}.mlp.down_proj.weight", (h, inter)
            yield f"{p}.input_layernorm.weight", (h,)
            yield f"{p}.post_attention_layernorm.weight", (h,)
        yield "model.norm.weight", (h,)
        if not config.get("tie_word_embeddings"):
            yield "lm_head.weight", (config["vocab_size"], h)

    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    size = 0

    def flush():
        nonlocal shard, size
        name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
        save_file(shard, folder / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
        shard, size = {}, 0

    for name, shape in tensors():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        shard[name] = t
        size += t.numel() * 2
        if size >= shard_bytes:
            flush()
    if shard:
        flush()
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


# ---- one case, in its own process -------------------------------------------------------------


class AnonSampler:
    """The peak of this process's anonymous RSS (not the checkpoint's mapped file pages),
    sampled from /proc/self/status every `interval` seconds."""

    def __init__(self, interval: float = 0.002):
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> dict[str, int]:
        out = {}
        for line in Path("/proc/self/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile", "VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read().get("RssAnon", 0))
            time.sleep(self.interval)

    def __enter__(self) -> AnonSampler:
        self.peak = self.read().get("RssAnon", 0)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.read().get("RssAnon", 0))


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def model_bytes(model) -> dict[str, int]:
    """Bytes of the model's parameters and buffers (each storage once), by dtype."""
    seen: set[int] = set()
    by_dtype: dict[str, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if t.device.type == "meta" or t.untyped_storage().data_ptr() in seen:
            continue
        seen.add(t.untyped_storage().data_ptr())
        key = str(t.dtype).removeprefix("torch.")
        by_dtype[key] = by_dtype.get(key, 0) + t.untyped_storage().nbytes()
    return by_dtype


def run_case(spec: dict) -> dict:
    import torch

    import inferengine
    from inferengine.attention.backends.torch_ref import TorchAttentionBackend
    from inferengine.config import ModelConfig
    from inferengine.model.loader.loader import load_model

    try:
        from inferengine.checkpoint.resolve import resolve_model
    except ImportError:  # a tree from before the checkpoint/ room (a --baseline-tree)
        from inferengine.model.loader.resolve import resolve_model

    device = torch.device(spec["device"])
    resolved = resolve_model(spec["model"], spec["load_format"])
    config = ModelConfig(
        model=spec["model"],
        model_path=str(resolved.path),
        hf_config=resolved.hf_config,
        dtype=spec["dtype"],
        max_model_len=2048,
        load_format=spec["load_format"],
        quantization=spec["quantization"],
    )
    if device.type == "cuda":
        torch.cuda.init()
        torch.cuda.reset_peak_memory_stats()
    before = peak_rss()
    anon_before = AnonSampler.read().get("RssAnon", 0)
    start = time.perf_counter()
    with AnonSampler() as anon:
        model = load_model(config, device, TorchAttentionBackend())
        if device.type == "cuda":
            torch.cuda.synchronize()
    out = {
        "tree": str(Path(inferengine.__file__).resolve().parent.parent),
        "load_s": round(time.perf_counter() - start, 2),
        "model_bytes": sum(model_bytes(model).values()),
        "model_bytes_by_dtype": model_bytes(model),
        "rss_before_load_bytes": before,
        "peak_rss_bytes": peak_rss(),
        "peak_rss_anon_sampled_bytes": anon.peak,
        "rss_after_load": AnonSampler.read(),
    }
    out["peak_rss_over_start_bytes"] = out["peak_rss_bytes"] - before
    out["peak_rss_anon_over_start_bytes"] = anon.peak - anon_before
    if device.type == "cuda":
        out["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        out["cuda_allocated_after_bytes"] = torch.cuda.memory_allocated()
        out["device_name"] = torch.cuda.get_device_name()
    return out


def spawn_case(spec: dict, tree: Path | None) -> dict:
    env = dict(os.environ)
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--case", json.dumps(spec)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-3000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the run ----------------------------------------------------------------------------------

PEAKS = (
    "peak_rss_over_start_bytes",
    "peak_rss_anon_over_start_bytes",
    "cuda_max_allocated_bytes",
    "load_s",
)


def median_run(runs: list[dict]) -> dict:
    """The first run with each peak replaced by the runs' median (the CPU's peaks vary by a
    few hundred MB from run to run with the allocator's arenas)."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    out = dict(ok[0])
    for key in PEAKS:
        if key in out:
            values = sorted(r[key] for r in ok)
            out[key] = values[len(values) // 2]
    return out


def summarize(case: dict, cuda: bool) -> str:
    peak = case["cuda_max_allocated_bytes"] if cuda else case["peak_rss_over_start_bytes"]
    what = "max_allocated" if cuda else "peak RSS over start"
    return (
        f"{case['label']:>8} {case['source']:>11} {case['quantization'] or 'bf16':>5}: "
        f"{what} {peak / GIB:6.2f} GiB, model {case['model_bytes'] / GIB:6.2f} GiB, "
        f"anon peak over start {case['peak_rss_anon_over_start_bytes'] / GIB:6.2f} GiB, "
        f"{case['load_s']} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--config", default=str(REPO / "configs" / "qwen2.5-7b"))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--sources", nargs="+", default=["dummy", "safetensors"])
    parser.add_argument("--scaled-heads", type=int, default=14)
    parser.add_argument("--scaled-kv-heads", type=int, default=2)
    parser.add_argument("--scaled-intermediate", type=int, default=9472)
    parser.add_argument("--scaled-layers", type=int, default=8)
    parser.add_argument("--scaled-vocab", type=int, default=32768)
    parser.add_argument("--shard-mb", type=int, default=256)
    parser.add_argument(
        "--full-checkpoint",
        action="store_true",
        help="the safetensors checkpoint at --config's shape",
    )
    parser.add_argument(
        "--repeats", type=int, help="loads per case, medians reported (default: CPU 3, CUDA 1)"
    )
    parser.add_argument("--baseline-tree", type=Path, help="another checkout to load from too")
    parser.add_argument("--out-root", help="results root (default benchmarks/results)")
    parser.add_argument("--out-dir", help="exactly this result folder")
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(json.loads(args.case))))
        return

    from result_folder import write_result_folder

    hf_config = json.loads((Path(args.config) / "config.json").read_text())
    scaled = scaled_config(hf_config, args)
    repeats = args.repeats or (1 if args.device == "cuda" else 3)
    trees = [("current", None)]
    if args.baseline_tree is not None:
        trees.append(("baseline", args.baseline_tree.resolve()))
    cases = []
    with tempfile.TemporaryDirectory(prefix="load-peak-") as tmp:
        small = Path(tmp) / "scaled"
        (small / "dummy").mkdir(parents=True)
        (small / "dummy" / "config.json").write_text(json.dumps(scaled, indent=1))
        models = {
            "dummy": (args.config if args.device == "cuda" else str(small / "dummy"), "dummy"),
            "safetensors": (str(small / "checkpoint"), "auto"),
        }
        if "safetensors" in args.sources:
            writer = subprocess.run(
                [sys.executable, "-c", "import sys, json; sys.path.insert(0, sys.argv[1]); "
                 "import load_peak as lp; from pathlib import Path; "
                 "lp.write_checkpoint(Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]))",
                 str(Path(__file__).resolve().parent), models["safetensors"][0],
                 json.dumps(hf_config if args.full_checkpoint else scaled),
                 str(args.shard_mb << 20)],
                capture_output=True, text=True,
            )  # fmt: skip
            if writer.returncode != 0:
                sys.exit(f"writing the checkpoint failed:\n{writer.stderr[-3000:]}")
        for source in args.sources:
            model, load_format = models[source]
            for label, tree in trees:
                for quantization in (None, "fp8"):
                    spec = {
                        "device": args.device,
                        "model": model,
                        "load_format": load_format,
                        "dtype": args.dtype,
                        "quantization": quantization,
                    }
                    runs = [spawn_case(spec, tree) for _ in range(repeats)]
                    result = median_run(runs)
                    case = {"label": label, "source": source, **spec, **result}
                    ok = [r for r in runs if "error" not in r]
                    if repeats > 1 and ok:
                        case["runs"] = {k: [r[k] for r in ok] for k in PEAKS if k in result}
                    for r in runs:
                        if "error" in r and r is not result:
                            print(f"{label} {source} {quantization}: a run FAILED\n{r['error']}")
                            case.setdefault("failed_runs", []).append(r["error"][-1000:])
                    full = (
                        args.full_checkpoint if source == "safetensors" else args.device == "cuda"
                    )
                    case["model"] = args.config if full else "scaled"
                    cases.append(case)
                    if "error" in result:
                        print(f"{label} {source} {quantization}: FAILED\n{result['error']}")
                    else:
                        print(summarize(case, args.device == "cuda"), flush=True)
    shapes = {
        "config": args.config,
        "scaled": {k: scaled[k] for k in ("hidden_size", "num_attention_heads",
                                          "num_key_value_heads", "intermediate_size",
                                          "num_hidden_layers", "vocab_size")},
    }  # fmt: skip
    results = {"device": args.device, "dtype": args.dtype, "shapes": shapes, "cases": cases}
    results["summary"] = [summarize(c, args.device == "cuda") for c in cases if "error" not in c]
    device = "cuda" if args.device == "cuda" else "cpu"
    folder = write_result_folder(f"load-peak-{device}", results, args.out_dir, root=args.out_root)
    print(f"wrote {folder}")


if __name__ == "__main__":
    main()
