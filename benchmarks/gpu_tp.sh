#!/bin/bash
# Tensor parallelism on the offline GPU host, kind `nvidia-h200-x2` (device tool; the 70B shape's
# 141 GB of bf16 weights need two H200s), each item's folder coming back as a tarball in $OUT:
#   allreduce      benchmarks/all_reduce_latency.py: NCCL against CustomAllReduce, bf16,
#                  8 KiB to 64 MiB, eager and in CUDA graphs
#   step           benchmarks/tp_decode_step.py: ms per decode step at batch 1 and 16 (prompts
#                  of 128 random tokens, 256 greedy tokens, ignore_eos, dummy weights) on
#                  llama-3-70b at TP=2 and qwen2.5-7b at TP=1 and TP=2 (step70, step7: a part)
#   paired[:K]     round K (default 0) of w1 and batch1 against vLLM 0.26.0, both at
#                  --tensor-parallel-size 2 on configs/llama-3-70b (dummy weights,
#                  --gpu-memory-utilization 0.90, --max-model-len 2048); `vllm bench serve` judges
#   c128[:K]       the same servers, workload c128 (384 prompts of 512 tokens, 256 out,
#                  concurrency 128), in a call of its own (each 70B server takes minutes to start)
# Run each item in a call of its own, within the device's 10 minutes:
#   GIT_REV=<sha> bash benchmarks/gpu_tp.sh allreduce
# Carry: for allreduce nothing; for step `.whl` (../shared/gpu/wheelhouse.sh: msgspec, pyzmq, ...),
# or nothing once a paired item has filled /tmp/site on the same warm host; for paired and c128
# stage vLLM's first part as gpu_paired.sh says (.peerA, then .peerB, each call within 30 s of
# the last) and carry .peer2 in the call that runs the item.
# NVLink multicast stays off in NCCL, torch and NVSHMEM, for our servers and vLLM's alike.
set -u
[ $# -gt 0 ] || { echo "usage: gpu_tp.sh allreduce|step|step70|step7|paired[:K]|c128[:K] ..." >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 INFERENGINE_CACHE_DIR=/tmp/ie-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
S=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p /tmp/pr
ie() { python3 -m inferengine.entrypoints.cli.main "$@"; }
pack() { tar czf "$OUT/$1.tgz" -C /tmp/pr "$1"; }
wheels() {  # the packages the host lacks, from the carried .whl unless /tmp/site has them
  if [ ! -d /tmp/site/msgspec ] && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD
}
step() {  # config name, tensor-parallel size
  local name=$S-tp-decode-$1-tp$2
  python3 benchmarks/tp_decode_step.py --model "configs/$1" --tp "$2" --out-dir "/tmp/pr/$name" \
    2>&1 | tail -25
  pack "$name"
}
sys_ie="inferengine=preset:inferengine --load-format dummy --tensor-parallel-size 2 --gpu-memory-utilization 0.90 --max-model-len 2048 --disable-log-requests"
sys_vl="vllm=preset:vllm --load-format dummy --dtype bfloat16 --tensor-parallel-size 2 --gpu-memory-utilization 0.90 --max-model-len 2048"
run_set() {  # round, name, paired args...
  local round=$1 short=$2 name=$S-$2-r$1; shift 2
  ie bench paired --system "$sys_ie" --system "$sys_vl" \
    --model-dir configs/llama-3-70b --served-model-name llama-3-70b --disable-tqdm \
    --repeats 1 --judge vllm --revision "${GIT_REV:-unknown}" --start-repeat "$round" \
    --name "$short" --out-dir "/tmp/pr/$name" --gate 'ready_s<=60@inferengine' "$@" \
    2>&1 | tail -60
  pack "$name"
}
for item in "$@"; do
  round=0
  [ "${item#*:}" != "$item" ] && round=${item#*:}
  case ${item%%:*} in
    allreduce)
      export PYTHONPATH=$PWD
      python3 benchmarks/all_reduce_latency.py --out-dir "/tmp/pr/$S-all-reduce-latency" 2>&1 |
        tail -30
      pack "$S-all-reduce-latency";;
    step|step70|step7)
      wheels
      [ "$item" != step7 ] && step llama-3-70b 2
      [ "$item" != step70 ] && { step qwen2.5-7b 1; step qwen2.5-7b 2; };;
    paired)
      . benchmarks/gpu_peer_site.sh
      run_set "$round" tp2-paired --workload w1 --workload batch1 \
        --gate 'w1:output_throughput>=1.05' --gate 'batch1:median_tpot_ms<=18@inferengine';;
    c128)
      . benchmarks/gpu_peer_site.sh
      run_set "$round" tp2-c128-paired --workload c128 --gate 'c128:output_throughput>=1.0';;
    *) echo "unknown item $item: allreduce, step, step70, step7, paired[:K] or c128[:K]" >&2; exit 2;;
  esac
done
