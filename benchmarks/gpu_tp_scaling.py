"""Tensor-parallel acceptance runs of issue [23] on the GPU host, and the tables they feed.

Items (run each in a device call of its own, within its 10 minutes; --dry-run prints the shell
lines instead of running them, with the device kind each needs):

    paired:MODEL:TP[:K]   round K of w1 and batch1 against vLLM 0.26.0, both at
                          --tensor-parallel-size TP (dummy weights, --max-model-len 2048,
                          --gpu-memory-utilization 0.90); batch1 carries the bandwidth floor
    c128:MODEL:TP[:K]     the same servers, workload c128 (concurrency 128)
    alone:MODEL:TP[:K]    ours alone at TP: w1, batch1 and c128 (the scaling table: TP 1/2/4/8)
    ray:MODEL:TP[:K]      ours with --distributed-executor-backend mp against ray, one node:
                          w1 and batch1 (what the Ray executor costs; needs `ray` on the host)

MODEL is llama-3-70b (TP 2, 4 or 8: 141 GB of bf16 weights, TP=2 needs H200s) or llama-3.1-8b
(TP 1, 2, 4 or 8; TP=8 is [31]'s, on nvidia-h100-x8 when lent). `vllm bench serve` judges; stage vLLM as benchmarks/gpu_paired.sh says (carry
.peer2), every folder comes back as $OUT/<folder>.tgz. Then, here:

    python3 benchmarks/gpu_tp_scaling.py tables benchmarks/results/<stamp>-tp*

prints the four tables (W1, batch-1 TPOT against the floor, c128, scaling over TP) and the Ray
row, from whichever folders are there.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

MODELS = {"llama-3-70b": (2, 4, 8), "llama-3.1-8b": (1, 2, 4, 8)}  # name -> tensor-parallel sizes
KINDS = ("paired", "c128", "alone", "ray")
WORKLOADS = {
    "paired": ["w1", "batch1"],
    "c128": ["c128"],
    "alone": ["w1", "batch1", "c128"],
    "ray": ["w1", "batch1"],
}
GATES = {  # as benchmarks/gpu_tp.sh asks of TP=2
    "paired": ["w1:output_throughput>=1.05"],
    "c128": ["c128:output_throughput>=1.0"],
}
COMMON = "--load-format dummy --gpu-memory-utilization 0.90 --max-model-len 2048"
ENV = (
    "PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 INFERENGINE_CACHE_DIR=/tmp/ie-cache "
    # NVLink multicast stays off in NCCL, torch and NVSHMEM, for our servers and vLLM's alike.
    "NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1"
)
NAME = re.compile(r"^tp(?P<tp>\d+)-(?P<model>.+)-(?P<kind>paired|c128|alone|ray)$")


@dataclass(frozen=True)
class Item:
    kind: str
    model: str
    tp: int
    round: int = 0

    @property
    def name(self) -> str:
        """The result folder's name after the stamp (the tables read it back)."""
        return f"tp{self.tp}-{self.model}-{self.kind}"

    @property
    def device_kind(self) -> str:
        """The device machine this item needs (the 70B at TP=2 only fits H200s)."""
        if self.model == "llama-3-70b" and self.tp == 2:
            return "nvidia-h200-x2 (needs_h200)"
        return {1: "nvidia-h100-x1", 2: "nvidia-h100-x2", 4: "nvidia-h100-x4", 8: "nvidia-h100-x8"}[
            self.tp
        ]


def parse_item(text: str) -> Item:
    parts = text.split(":")
    if len(parts) not in (3, 4) or parts[0] not in KINDS:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write KIND:MODEL:TP[:ROUND], KIND one of {', '.join(KINDS)}"
        )
    kind, model, tp_text = parts[:3]
    if model not in MODELS:
        raise argparse.ArgumentTypeError(f"{text!r}: MODEL is one of {', '.join(MODELS)}")
    if not tp_text.isdigit() or int(tp_text) not in MODELS[model]:
        sizes = ", ".join(map(str, MODELS[model]))
        raise argparse.ArgumentTypeError(f"{text!r}: {model} runs at TP {sizes}")
    if len(parts) == 4 and not parts[3].isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: ROUND is a number")
    return Item(kind, model, int(tp_text), int(parts[3]) if len(parts) == 4 else 0)


def systems(item: Item) -> list[str]:
    tp = f"--tensor-parallel-size {item.tp}"
    ours = f"preset:inferengine {COMMON} {tp} --disable-log-requests"
    if item.kind == "ray":
        return [
            f"mp={ours} --distributed-executor-backend mp",
            f"ray={ours} --distributed-executor-backend ray",
        ]
    vllm = f"vllm=preset:vllm {COMMON} --dtype bfloat16 {tp}"
    return [f"inferengine={ours}"] + ([] if item.kind == "alone" else [vllm])


def bench_command(item: Item, folder: Path, revision: str) -> list[str]:
    """The `inferengine bench paired` command line of one item."""
    argv = ["python3", "-m", "inferengine.entrypoints.cli.main", "bench", "paired"]
    for spec in systems(item):
        argv += ["--system", spec]
    argv += ["--model-dir", f"configs/{item.model}", "--served-model-name", item.model]
    argv += ["--disable-tqdm", "--repeats", "1", "--judge", "vllm", "--revision", revision]
    argv += ["--start-repeat", str(item.round), "--name", item.name, "--out-dir", str(folder)]
    for workload in WORKLOADS[item.kind]:
        argv += ["--workload", workload]
    for gate in GATES.get(item.kind, []):
        argv += ["--gate", gate]
    return argv


def shell_line(item: Item, stamp: str, root: Path, revision: str) -> str:
    """The whole step: vLLM's site (and ray's check), the run, the tarball into $OUT."""
    folder = root / f"{stamp}-{item.name}-r{item.round}"
    setup = ". benchmarks/gpu_peer_site.sh"
    if item.kind == "ray":
        setup += ' && python3 -c "import ray" || { echo "ray is not on this host" >&2; exit 2; }'
    run = f"env {ENV} {shlex.join(bench_command(item, folder, revision))}"
    pack = f'tar czf "$OUT/{folder.name}.tgz" -C {shlex.quote(str(root))} {folder.name}'
    return f"{setup} && {{ {run} 2>&1 | tail -60; }}; {pack}"


# ---- tables ----------------------------------------------------------------------------------


def load(folders: list[Path]) -> list[tuple[Item, dict]]:
    """(item, summary) of each result folder this script wrote; others are skipped."""
    found = []
    for folder in folders:
        path = folder / "summary.json"
        if not path.is_file():
            continue
        summary = json.loads(path.read_text())
        match = NAME.match(summary.get("name", ""))
        if match:
            item = Item(match["kind"], match["model"], int(match["tp"]))
            found.append((item, summary))
    return found


def _median(summary: dict, workload: str, system: str, metric: str) -> float | None:
    try:
        return summary["workloads"][workload]["systems"][system]["spread"][metric]["median"]
    except (KeyError, TypeError):
        return None


def _fmt(value: float | None, spec: str = "{:,.0f}") -> str:
    return "–" if value is None else spec.format(value)


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if not a or not b else f"{a / b:.2f}"


def tables(found: list[tuple[Item, dict]]) -> list[str]:
    """The markdown tables of [23]: each row one folder, sorted by shape and TP."""
    found = sorted(found, key=lambda f: (f[0].model, f[0].tp, f[0].kind))
    of = {kind: [(i, s) for i, s in found if i.kind == kind] for kind in KINDS}
    out = ["## W1 (output tok/s)", "", "| shape | TP | InferEngine | vLLM | ratio |"]
    out.append("| --- | --- | --- | --- | --- |")
    for item, s in of["paired"]:
        a, b = (_median(s, "w1", n, "output_throughput") for n in ("inferengine", "vllm"))
        out.append(f"| {item.model} | {item.tp} | {_fmt(a)} | {_fmt(b)} | {_ratio(a, b)} |")
    out += ["", "## Batch 1: median TPOT (ms) against the bandwidth floor", ""]
    out += ["| shape | TP | floor | InferEngine | × floor | vLLM | × floor |"]
    out.append("| --- | --- | --- | --- | --- | --- | --- |")
    for item, s in of["paired"] + of["alone"]:
        floor = (s["workloads"].get("batch1", {}).get("floor") or {}).get("floor_ms")
        cells = []
        for name in ("inferengine", "vllm"):
            tpot = _median(s, "batch1", name, "median_tpot_ms")
            cells += [_fmt(tpot, "{:.2f}"), _ratio(tpot, floor)]
        out.append(f"| {item.model} | {item.tp} | {_fmt(floor, '{:.2f}')} | {' | '.join(cells)} |")
    out += ["", "## c128 (output tok/s; median TPOT ms)", ""]
    out += ["| shape | TP | InferEngine | vLLM | ratio |", "| --- | --- | --- | --- | --- |"]
    for item, s in of["c128"]:
        a, b = (_median(s, "c128", n, "output_throughput") for n in ("inferengine", "vllm"))
        ta, tb = (_median(s, "c128", n, "median_tpot_ms") for n in ("inferengine", "vllm"))
        cell_a, cell_b = f"{_fmt(a)}; {_fmt(ta, '{:.1f}')}", f"{_fmt(b)}; {_fmt(tb, '{:.1f}')}"
        out.append(f"| {item.model} | {item.tp} | {cell_a} | {cell_b} | {_ratio(a, b)} |")
    out += ["", "## Scaling over TP (InferEngine alone)", ""]
    out += ["| shape | TP | w1 tok/s | c128 tok/s | c128 × smallest TP | batch-1 TPOT ms |"]
    out.append("| --- | --- | --- | --- | --- | --- |")
    base: dict[str, float | None] = {}
    for item, s in of["alone"]:
        c128 = _median(s, "c128", "inferengine", "output_throughput")
        base.setdefault(item.model, c128)
        w1 = _median(s, "w1", "inferengine", "output_throughput")
        tpot = _median(s, "batch1", "inferengine", "median_tpot_ms")
        row = [_fmt(w1), _fmt(c128), _ratio(c128, base[item.model]), _fmt(tpot, "{:.2f}")]
        out.append(f"| {item.model} | {item.tp} | {' | '.join(row)} |")
    if of["ray"]:
        out += ["", "## Ray executor against worker processes (one node)", ""]
        out += ["| shape | TP | w1 mp | w1 ray | ratio | TPOT mp | TPOT ray |"]
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for item, s in of["ray"]:
            a, b = (_median(s, "w1", n, "output_throughput") for n in ("mp", "ray"))
            ta, tb = (_median(s, "batch1", n, "median_tpot_ms") for n in ("mp", "ray"))
            cells = f"{_fmt(a)} | {_fmt(b)} | {_ratio(b, a)} | {_fmt(ta, '{:.2f}')} | {_fmt(tb, '{:.2f}')}"
            out.append(f"| {item.model} | {item.tp} | {cells} |")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tables"]:
        print("\n".join(tables(load([Path(a) for a in argv[1:]]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("items", nargs="+", type=parse_item, metavar="KIND:MODEL:TP[:ROUND]")
    parser.add_argument("--dry-run", action="store_true", help="print the shell lines only")
    parser.add_argument("--out-root", type=Path, default=Path("/tmp/pr"))
    parser.add_argument("--revision", default=os.environ.get("GIT_REV", "unknown"))
    parser.add_argument("--stamp", default=datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ"))
    args = parser.parse_args(argv)
    status = 0
    for item in args.items:
        line = shell_line(item, args.stamp, args.out_root, args.revision)
        if args.dry_run:
            print(f"# {item.name} round {item.round}: device kind {item.device_kind}")
            print(line)
            continue
        args.out_root.mkdir(parents=True, exist_ok=True)
        status = subprocess.run(["bash", "-c", line], check=False).returncode or status
    return status


if __name__ == "__main__":
    sys.exit(main())
