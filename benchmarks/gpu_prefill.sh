#!/bin/bash
# The acceptance rounds of [22] on the offline GPU host (device tool), against vLLM 0.26.0 with
# vLLM alone beside: each item is one call's worth (under 10 minutes on an H100):
#   GIT_REV=<sha> bash benchmarks/gpu_prefill.sh 0:short      # then 0:long, 1:short, 1:long, ...
#   GIT_REV=<sha> bash benchmarks/gpu_prefill.sh profile      # per-op profile, a call of its own
#   bash benchmarks/gpu_prefill.sh --dry-run 0:short 0:long profile   # print the commands only
# K:short runs round K of w1, batch1, c256 and shared-prefix (servers at --max-model-len 2048),
# K:long round K of rag, long-prompt, batch1-8k and prefill-only (at 8448; prefill-only with
# its MFU over the bf16 matmul peak measured in the same call). In both, the systems are ours,
# vLLM as the harness starts it and vLLM alone (`vllm serve` + `vllm bench serve` as a user
# runs them, nothing else on the host), launched in an order rotated by K; `vllm bench serve`
# judges and nothing of ours runs during its window (inferengine/bench/paired_launch.py).
# Three rounds (K = 0, 1, 2) give every system every position once. `profile` runs
# benchmarks/prefill_profile.py (torch.profiler on an 8192-token chunk and on 64 decodes + a
# 2048-token chunk). Each item leaves a compacted folder (summary.json, the commands in
# environment.txt, the revision, trimmed logs; under 200 kB) as a tarball in $OUT.
# Before it, stage vLLM as gpu_paired.sh's header says, and carry .peer2 in every call.
set -u
dry=0; [ "${1:-}" = --dry-run ] && { dry=1; shift; }
[ $# -gt 0 ] || { echo "usage: gpu_prefill.sh [--dry-run] ROUND:short|ROUND:long|profile ..." >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
[ $dry = 1 ] || . benchmarks/gpu_peer_site.sh
S=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-/tmp/out}
MODEL=${MODEL:-qwen2.5-7b}
run() { if [ $dry = 1 ]; then printf '%q ' "$@"; echo; else "$@"; fi; }
pack() {  # folder name: compact it, keep it under the budget, tar it into $OUT
  [ $dry = 1 ] && { echo "# then: compact_results.py /tmp/pr/$1 and tar it into \$OUT"; return; }
  python3 benchmarks/compact_results.py "/tmp/pr/$1" | tail -2
  python3 benchmarks/compact_results.py --check "/tmp/pr/$1" | tail -1
  mkdir -p "$OUT" && tar czf "$OUT/$1.tgz" -C /tmp/pr "$1"
}
paired_set() {  # round, name, max-model-len, paired args...
  local round=$1 name=$2 len=$3; shift 3
  local d=$S-$name-r$round util=${UTIL:-0.82}
  run python3 -m inferengine.entrypoints.cli.main bench paired \
    --system "inferengine=preset:inferengine --load-format dummy --gpu-memory-utilization $util --disable-log-requests --max-model-len $len" \
    --system "vllm=preset:vllm --load-format dummy --dtype bfloat16 --gpu-memory-utilization $util --max-model-len $len" \
    --alone vllm --model-dir "configs/$MODEL" --served-model-name "$MODEL" --disable-tqdm \
    --repeats 1 --start-repeat "$round" --judge vllm --revision "${GIT_REV:-unknown}" \
    --name "$name" --out-dir "/tmp/pr/$d" "$@"
  pack "$d"
}
for item in "$@"; do
  case $item in
    *:short) paired_set "${item%%:*}" accept-short 2048 \
      --workload w1 --workload batch1 --workload c256 --workload shared-prefix \
      --gate 'w1:output_throughput>=1.0' --gate 'c256:output_throughput>=1.0' \
      --gate 'batch1:median_tpot_ms<=1.0' --gate 'shared-prefix:output_throughput>=1.0';;
    *:long) paired_set "${item%%:*}" accept-long 8448 \
      --workload rag --workload long-prompt --workload batch1-8k --workload prefill-only \
      --gate 'rag:output_throughput>=1.0' --gate 'long-prompt:output_throughput>=1.0' \
      --gate 'batch1-8k:median_ttft_ms<=1.0' --gate 'prefill-only:total_token_throughput>=1.0';;
    profile) d=$S-prefill-profile
      run python3 benchmarks/prefill_profile.py --model "configs/$MODEL" --out "/tmp/pr/$d" \
        --revision "${GIT_REV:-unknown}"
      pack "$d";;
    *) echo "unknown item $item: write ROUND:short, ROUND:long or profile" >&2; exit 2;;
  esac
done
