#!/bin/bash
# The [7] paired benchmarks against vLLM 0.26.0 on the offline GPU host (device tool), as run
# for the README: bash benchmarks/gpu_paired.sh w1 batch1 [c256]
# Before it, put vLLM's first part on the host: ../shared/peers/vllm-prepare.sh leaves .peer1
# (56 MiB) and .peer2; .peer1 with the checkout is over one call's 64 MiB, so split it here
#   split -b 29360128 -d .peer1/part.00 /tmp/p1. && mkdir -p .peerA .peerB &&
#   mv /tmp/p1.00 .peerA/p && mv /tmp/p1.01 .peerB/p   (both folders in .git/info/exclude)
# and send the halves in two calls, each within 30 s of the last:
#   carry .peerA: mkdir -p /tmp/vllm-parts && cp .peerA/p /tmp/vllm-parts/part.00.a
#   carry .peerB: cat /tmp/vllm-parts/part.00.a .peerB/p > /tmp/vllm-parts/part.00
# then carry .peer2 in the call that runs this script. Result folders come back as tarballs.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ ! -d /tmp/vllm-site/vllm ]; then
  mkdir -p /tmp/vllm-site
  cat /tmp/vllm-parts/part.00 .peer2/part.0* | xz -dc | tar x -C /tmp/vllm-site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site .peer2/w/*.whl || exit 1
fi
if [ ! -d /tmp/site/fastapi ]; then
  w=.peer2/w
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $w/annotated_types-* $w/fastapi-* $w/msgspec-* $w/pydantic-2* $w/pydantic_core-* $w/pyzmq-* $w/sniffio-* \
    $w/starlette-* $w/typing_inspection-* $w/uvicorn-* || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
cat > /tmp/ie <<'X'
#!/bin/bash
exec python3 -m inferengine.entrypoints.cli.main "$@"
X
chmod +x /tmp/ie
S=$(date -u +%Y%m%dT%H%M%SZ)
IE='inferengine=preset:inferengine --load-format dummy --max-model-len 2048 --gpu-memory-utilization 0.82 --disable-log-requests'
VL='vllm=preset:vllm --load-format dummy --dtype bfloat16 --max-model-len 2048 --gpu-memory-utilization 0.82'
common=(--system "$IE" --system "$VL" --model-dir configs/qwen2.5-7b --served-model-name qwen2.5-7b --ignore-eos --disable-tqdm --client vllm)
for name in "$@"; do
  case $name in
    w1) args=(--random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --num-prompts 100 --max-concurrency 16 --num-warmups 16
              --gate 'output_throughput>=1.05' --gate 'median_itl_ms<=6.0@inferengine' --gate 'median_ttft_ms<=1.0' --gate 'ready_s<=30@inferengine');;
    batch1) args=(--random-input-len 256 --random-output-len 128 --num-prompts 8 --max-concurrency 1 --num-warmups 2 --gate 'median_tpot_ms<=5.7@inferengine');;
    c256) args=(--random-input-len 512 --random-output-len 256 --num-prompts 500 --max-concurrency 256 --gate 'output_throughput>=1.0');;
  esac
  d=/tmp/pr/$S-$name-paired
  /tmp/ie bench paired "${common[@]}" --name $name "${args[@]}" --out-dir $d 2>&1 | tail -25
  tar czf $OUT/$S-$name-paired.tgz -C /tmp/pr $S-$name-paired
done
