#!/bin/bash
# The paired benchmarks against vLLM 0.26.0 on the offline GPU host (device tool), as run for
# the README, the launch order alternating from round to round:
#   GIT_REV=<sha> bash benchmarks/gpu_paired.sh 0:short 0:long   # then 1:..., then 2:...
# K:short runs round K of w1, batch1, c256 and shared-prefix against servers at
# --max-model-len 2048, K:json round K of the JSON-schema workloads and their plain twins (vLLM
# with its default structured-output backend, xgrammar, for these schemas) at 2048,
# K:json16 only the concurrency-16 pair of those (half the time),
# K:long round K of long-prompt against servers at 8192 (split the items
# over calls so that each stays within the device's 10 minutes); `vllm bench serve` judges.
# Each folder comes back as a tarball; benchmarks/readme_performance.py reads the rounds
# together.
# Before it, put vLLM's first part on the host: ../shared/peers/vllm-prepare.sh leaves .peer1
# (56 MiB) and .peer2; .peer1 with the checkout is over one call's 64 MiB, so split it here
#   split -b 29360128 -d .peer1/part.00 /tmp/p1. && mkdir -p .peerA .peerB &&
#   mv /tmp/p1.00 .peerA/p && mv /tmp/p1.01 .peerB/p   (both folders in .git/info/exclude)
# and send the halves in two calls, each within 30 s of the last:
#   carry .peerA: mkdir -p /tmp/vllm-parts && cp .peerA/p /tmp/vllm-parts/part.00.a
#   carry .peerB: cat /tmp/vllm-parts/part.00.a .peerB/p > /tmp/vllm-parts/part.00
# then carry .peer2 in every call that runs this script.
set -u
[ $# -gt 0 ] || { echo "usage: gpu_paired.sh ROUND:short|ROUND:long ..." >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
. benchmarks/gpu_peer_site.sh
S=$(date -u +%Y%m%dT%H%M%SZ)
ie() { python3 -m inferengine.entrypoints.cli.main "$@"; }
sys_ie="inferengine=preset:inferengine --load-format dummy --gpu-memory-utilization 0.82 --disable-log-requests"
sys_vl="vllm=preset:vllm --load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.82"
common=(--model-dir configs/qwen2.5-7b --served-model-name qwen2.5-7b --disable-tqdm
        --repeats 1 --judge vllm --revision "${GIT_REV:-unknown}")
run_set() {  # round, name, max-model-len, paired args...
  local round=$1 name=$2 len=$3; shift 3
  local d=/tmp/pr/$S-$name-r$round
  ie bench paired --system "$sys_ie --max-model-len $len" --system "$sys_vl --max-model-len $len" \
    "${common[@]}" --start-repeat "$round" --name "$name" --out-dir "$d" "$@" 2>&1 | tail -60
  tar czf "$OUT/$S-$name-r$round.tgz" -C /tmp/pr "$S-$name-r$round"
}
for item in "$@"; do
  case ${item#*:} in
    short) run_set "${item%%:*}" paired 2048 \
      --workload w1 --workload batch1 --workload c256 --workload shared-prefix \
      --gate 'w1:output_throughput>=1.05' --gate 'w1:median_itl_ms<=6.0@inferengine' \
      --gate 'w1:median_ttft_ms<=1.0' --gate 'ready_s<=30@inferengine' \
      --gate 'batch1:median_tpot_ms<=5.7@inferengine' --gate 'c256:output_throughput>=1.0';;
    json) run_set "${item%%:*}" json-paired 2048 \
      --workload json-c16-plain --workload json-c16 --workload json-c64-plain --workload json-c64 \
      --gate 'json-c16:output_throughput>=1.0' --gate 'json-c64:output_throughput>=1.0';;
    json16) run_set "${item%%:*}" json-paired 2048 --workload json-c16-plain --workload json-c16 \
      --gate 'json-c16:output_throughput>=1.0';;
    long) run_set "${item%%:*}" long-prompt-paired 8192 --workload long-prompt;;
    *) echo "unknown item $item: write ROUND:short, ROUND:json or ROUND:long" >&2; exit 2;;
  esac
done
