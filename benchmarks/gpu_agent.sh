#!/bin/bash
# Multi-turn agent sessions (`inferengine bench agent`) against vLLM 0.26.0 on the offline GPU host
# (device tool, one H100), Qwen2.5-7B shape, bf16, dummy weights; each item's folder comes back
# as a tarball in $OUT:
#   K:pair      round K: inferengine with its CPU tier (--kv-offloading-size) against vLLM with
#               prefix caching only
#   K:offload   round K: inferengine against vLLM with its native CPU offload
#               (--kv-offloading-size, the OffloadingConnector), the same CPU budget
#   K:ours      round K's sessions against inferengine alone (a check before paired rounds)
#   K:short     round K of the pair on shorter sessions (below), where most of vLLM's later
#               turns still hit its GPU cache
#   smoke       the script's path on the CPU (no GPU, no vLLM): our server on smollm2-135m with
#               dummy weights, a 512-token pool and a small CPU tier, 4 sessions x 3 turns
# Round K rotates the launch order (K even: inferengine first) and uses sessions of seed K. Run
# one item per call, within the device's 10 minutes (vLLM is ready 90-140 s after launch):
#   GIT_REV=<sha> bash benchmarks/gpu_agent.sh 0:pair      # then 1:pair, 0:offload, ...
# Stage vLLM's first part as benchmarks/gpu_paired.sh says (.peerA, then .peerB, each call within
# 30 s of the last) and carry .peer2 in the call that runs a pair or offload item.
#
# Both servers get the same KV pool: --num-gpu-blocks-override 4096 pages of 16 tokens =
# 65,536 tokens x 57,344 B (28 layers x 4 KV heads x 128 x 2 (K, V) x 2 B) = 3.5 GiB. The
# workload, an agent's shape at a tenth of the traces' length (vLLM's agent traces: median 142k
# input tokens): 48 sessions, at most 24 at once, started 0.5 s apart on average; a 6,144-token
# prefix (2,048 shared by all: the system prompt and tool schemas; the rest the task's own);
# 8 turns, each adding a 128-token reply and a tool output of 200-400 tokens after an
# exponential think time of mean 3 s. A session ends at about 9,600 tokens: 24 active sessions
# hold ~190k tokens (2.9x the pool), all 48 ~363k distinct tokens (19.4 GiB), which a 24 GiB
# CPU tier holds. The longest prompt is 10,240 tokens (+128 out), within --max-model-len 12288.
# A run takes about two minutes per system.
# Target (gates): median TTFT of turns >= 2 at most 1/3 of vLLM's, output throughput >= vLLM's.
set -u
[ $# -gt 0 ] || { echo "usage: gpu_agent.sh ROUND:pair|ROUND:short|ROUND:offload|ROUND:ours|smoke ..." >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
S=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-/tmp/agent-out}
mkdir -p /tmp/pr "$OUT"
ie() { python3 -m inferengine.entrypoints.cli.main "$@"; }
pool="--num-gpu-blocks-override 4096 --gpu-memory-utilization 0.82 --max-model-len 12288"
cpu_gib=24
sys_ie="inferengine=preset:inferengine --load-format dummy $pool --kv-offloading-size $cpu_gib --disable-log-requests"
vl="preset:vllm --load-format dummy --dtype bfloat16 $pool --enable-prefix-caching --enable-prompt-tokens-details"
sys_vl="vllm=$vl"
sys_vo="vllm-offload=$vl --kv-offloading-size $cpu_gib"
workload=(--sessions 48 --turns 8 --prefix-len 6144 --shared-prefix-len 2048 --tool-len 200:400
          --output-len 128 --think-time 3 --think-distribution exponential --session-gap 0.5
          --max-active-sessions 24 --num-warmups 8 --prompt-cache-retention 1h)
# The shorter sessions: 2,048-token prefixes (512 shared) ending at ~5,200 tokens, 32 at once
# started 0.25 s apart (~166k tokens active, 2.5x the pool).
short=(--sessions 48 --turns 8 --prefix-len 2048 --shared-prefix-len 512 --tool-len 200:400
       --output-len 128 --think-time 3 --think-distribution exponential --session-gap 0.25
       --max-active-sessions 32 --num-warmups 8 --prompt-cache-retention 1h)
gates=(--gate 'later_median_ttft_ms<=0.3334' --gate 'output_throughput>=1.0')
run_set() {  # round, name, agent args... (the sessions: "${load[@]}")
  local round=$1 label=$2 name=$S-$2-r$1; shift 2
  ie bench agent --model-dir configs/qwen2.5-7b --served-model-name qwen2.5-7b "${load[@]}" \
    --repeats 1 --start-repeat "$round" --revision "${GIT_REV:-unknown}" --name "$label" \
    --out-dir "/tmp/pr/$name" "$@" 2>&1 | tail -40
  tar czf "$OUT/$name.tgz" -C /tmp/pr "$name"
}
for item in "$@"; do
  load=("${workload[@]}")
  case $item in
    smoke)
      export PYTHONPATH=$PWD
      name=$S-agent-smoke
      ie bench agent --model-dir configs/smollm2-135m --served-model-name smollm2 \
        --system "inferengine=preset:inferengine --load-format dummy --device cpu --max-model-len 256 --num-gpu-blocks-override 32 --kv-offloading-size 0.05 --disable-log-requests" \
        --sessions 4 --turns 3 --prefix-len 128 --tool-len 16:32 --output-len 8 --think-time 0.5 \
        --session-gap 0.1 --max-active-sessions 3 --num-warmups 1 \
        --revision "${GIT_REV:-unknown}" --name agent-smoke --out-dir "/tmp/pr/$name" 2>&1 | tail -25
      tar czf "$OUT/$name.tgz" -C /tmp/pr "$name";;
    *:pair)
      . benchmarks/gpu_peer_site.sh
      run_set "${item%%:*}" agent "${gates[@]}" --system "$sys_ie" --system "$sys_vl";;
    *:ours)
      run_set "${item%%:*}" agent-ours --system "$sys_ie";;
    *:short)
      . benchmarks/gpu_peer_site.sh
      load=("${short[@]}")
      run_set "${item%%:*}" agent-short "${gates[@]}" --system "$sys_ie" --system "$sys_vl";;
    *:offload)
      . benchmarks/gpu_peer_site.sh
      run_set "${item%%:*}" agent-offload "${gates[@]}" --system "$sys_ie" --system "$sys_vo";;
    *) echo "unknown item $item: ROUND:pair, ROUND:short, ROUND:offload, ROUND:ours or smoke" >&2; exit 2;;
  esac
done
