#!/bin/bash
# The paired benchmarks against vLLM 0.26.0 on the offline GPU host (device tool), as run for
# the README, the launch order alternating from round to round:
#   GIT_REV=<sha> bash benchmarks/gpu_paired.sh 0:short 0:long   # then 1:..., then 2:...
# K:short runs round K of w1, batch1, c256 and shared-prefix against servers at
# --max-model-len 2048, K:json round K of the JSON-schema workloads and their plain twins (vLLM
# with its default structured-output backend, xgrammar, for these schemas) at 2048,
# K:json16 only the concurrency-16 pair of those (half the time),
# K:long round K of long-prompt against servers at 8192, K:fp8 round K of w1, batch1 and
# c256 with both servers at `--quantization fp8 --kv-cache-dtype fp8` (vLLM's quantization
# needs compressed-tensors and loguru in .whl: gpu_peer_site.sh), K:fp8-self our FP8 server
# against our bf16 one (batch 1 and concurrency 256; vLLM only judges), K:moe round K of W1 and concurrency
# 64 on the Qwen3-30B-A3B shape (61 GB of bf16 weights, so both servers at 0.92 of the GPU;
# split the items over calls so that each stays within the device's 10 minutes); `vllm bench
# serve` judges.
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
# K:moe needs the MoE extension the stripped vLLM lacks: `bash benchmarks/gpu_paired.sh
# prepare-moe` here leaves it in .peerM (40 MB, in .git/info/exclude); send it in a third call,
#   carry .peerM: mkdir -p /tmp/vllm-parts && cp .peerM/moe.so.xz /tmp/vllm-parts/
# and gpu_peer_site.sh puts it back in vLLM's site.
set -u
[ $# -gt 0 ] || { echo "usage: gpu_paired.sh ROUND:short|ROUND:json|ROUND:long|ROUND:fp8|ROUND:fp8-self|ROUND:moe ... | prepare-moe" >&2; exit 2; }
if [ "$1" = prepare-moe ]; then  # here, not on the host: vLLM's MoE extension from its wheel
  set -e; w=$(mktemp -d); mkdir -p .peerM
  grep -qx "/.peerM/" .git/info/exclude || echo "/.peerM/" >> .git/info/exclude
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$w" vllm==0.26.0
  python3 -c "import sys, zipfile; sys.stdout.buffer.write(zipfile.ZipFile(sys.argv[1]).read('vllm/_moe_C_stable_libtorch.abi3.so'))" \
    "$w"/vllm-0.26.0-*.whl | xz -T0 -9e > .peerM/moe.so.xz
  rm -rf "$w"; ls -la .peerM; exit 0
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
. benchmarks/gpu_peer_site.sh
S=$(date -u +%Y%m%dT%H%M%SZ)
ie() { python3 -m inferengine.entrypoints.cli.main "$@"; }
run_set() {  # round, name, max-model-len, paired args... (MODEL, UTIL, QUANT, SELF: caller's)
  local round=$1 name=$2 len=$3 model=${MODEL:-qwen2.5-7b} util=${UTIL:-0.82}; shift 3
  local d=/tmp/pr/$S-$name-r$round q=${QUANT:-}
  local ie_sys="inferengine=preset:inferengine --load-format dummy --gpu-memory-utilization $util --disable-log-requests $q"
  local vl_sys="vllm=preset:vllm --load-format dummy --dtype bfloat16 --gpu-memory-utilization $util $q"
  [ "${SELF:-}" = 1 ] && vl_sys="bf16=preset:inferengine --load-format dummy --gpu-memory-utilization $util --disable-log-requests"
  ie bench paired --system "$ie_sys --max-model-len $len" --system "$vl_sys --max-model-len $len" \
    --model-dir "configs/$model" --served-model-name "$model" --disable-tqdm --repeats 1 \
    --judge vllm --revision "${GIT_REV:-unknown}" \
    --start-repeat "$round" --name "$name" --out-dir "$d" "$@" 2>&1 | tail -60
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
    fp8) QUANT="--quantization fp8 --kv-cache-dtype fp8" run_set "${item%%:*}" fp8-paired 2048 \
      --workload w1 --workload batch1 --workload c256 \
      --gate 'w1:output_throughput>=1.05' --gate 'c256:output_throughput>=1.05';;
    fp8-self) SELF=1 QUANT="--quantization fp8 --kv-cache-dtype fp8" run_set "${item%%:*}" \
      fp8-vs-bf16 2048 --workload batch1 --workload c256;;
    moe) MODEL=qwen3-30b-a3b UTIL=0.92 run_set "${item%%:*}" moe-paired 2048 --workload w1 --workload c64;;
    *) echo "unknown item $item: write ROUND:short, ROUND:json, ROUND:long, ROUND:fp8, ROUND:fp8-self or ROUND:moe" >&2; exit 2;;
  esac
done
