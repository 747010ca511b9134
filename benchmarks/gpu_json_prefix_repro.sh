#!/bin/bash
# Reproduces the open structured-output bug (README, "Known weak spots"): on the H100, JSON
# requests that follow plain requests with the same prompts (prefix-cache hits) fail, the grammar
# refusing a first token it should have masked; JSON requests first do not. Our server and the
# judge's client (`vllm bench serve`, json-c16 of gpu_paired.sh); server logs to $OUT.
# Staging as in gpu_paired.sh: .peerA and .peerB calls, then carry .peer2 and .whl:
#   bash benchmarks/gpu_json_prefix_repro.sh
. benchmarks/gpu_peer_site.sh >/dev/null 2>&1
export HF_HUB_OFFLINE=1
SCHEMA='{"structured_outputs": {"json": {"type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 24}, "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}, "summary": {"type": "string"}}, "required": ["id", "name", "tags", "summary"], "additionalProperties": false}}}'
bench() {  # port label extra...
  local port=$1 label=$2; shift 2
  env PYTHONPATH=/tmp/vllm-site python3 -m vllm.entrypoints.cli.main bench serve --backend openai --base-url http://127.0.0.1:$port --endpoint /v1/completions --model qwen2.5-7b --tokenizer configs/qwen2.5-7b --dataset-name random --num-prompts 200 --seed 0 --random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --request-rate inf --max-concurrency 16 --num-warmups 16 --temperature 1.0 --ignore-eos --disable-tqdm "$@" 2>&1 | grep -E "Successful|Failed requests|Error 0|Output token throughput" | sed "s/^/[$label] /"
}
serve() {  # port log
  python3 -m inferengine.entrypoints.cli.main serve configs/qwen2.5-7b --host 127.0.0.1 --port $1 --served-model-name qwen2.5-7b --load-format dummy --max-model-len 2048 --gpu-memory-utilization 0.82 > $2 2>&1 &
  echo $! > /tmp/srv.pid
  for i in $(seq 200); do curl -sf http://127.0.0.1:$1/health >/dev/null && break; sleep 1; done
}
serve 18101 /tmp/a.log
bench 18101 a-plain
bench 18101 a-json --extra-body "$SCHEMA"
kill $(cat /tmp/srv.pid); sleep 5
serve 18102 /tmp/b.log
bench 18102 b-json-first --extra-body "$SCHEMA"
kill $(cat /tmp/srv.pid); sleep 3
for f in a b; do echo "== $f refused: $(grep -c refused /tmp/$f.log)"; grep -m1 -B30 "refused" /tmp/$f.log | grep -v "POST\|GET" | cut -c1-300 | tail -12; done
mkdir -p $OUT && grep -v "POST\|GET" /tmp/a.log | head -400 > $OUT/a.log; grep -v "POST\|GET" /tmp/b.log | head -400 > $OUT/b.log
