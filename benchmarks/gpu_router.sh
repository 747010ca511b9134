#!/bin/bash
# Two data-parallel replicas behind one endpoint, cache-aware routing against round-robin, on the
# offline GPU host (device tool). Each item's result folder comes back as a tarball in $OUT:
#   stage-a      copy the first half of Ray's wheel (carry .rayA) to /tmp/ray-parts
#   stage-b      join it with the second half (carry .rayB, which holds Ray's small dependencies
#                too) and install them into /tmp/site
#   K:table      round K: `inferengine bench agent` against two servers, each two replicas of the
#                Llama-3.2-1B shape (dummy weights, bf16) sharing the one GPU
#                (--kv-cache-memory sized, see below): --router-policy cache-aware, then
#                round-robin (K odd: the other order); carry .whl
#   smoke        the same path on the CPU (no GPU): smollm2-135m, two tiny replicas, local Ray
# Prepare Ray's parts here (needs the network), then run stage-a, stage-b and the rounds, each
# call within 30 s of the last (the host keeps /tmp only while it stays warm):
#   bash benchmarks/gpu_router.sh prepare
#   GIT_REV=<sha> bash benchmarks/gpu_router.sh 0:table
#
# The workload: 64 sessions (at most 32 at once, started 0.25 s apart), each a 2,048-token
# prefix (1,024 shared by all: the system prompt) and 6 turns adding a 128-token reply and a
# 200-400-token tool output after an exponential think time of mean 1 s; sessions end at about
# 4,600 tokens, so 32 active sessions hold ~106k tokens. Each replica's KV cache is 2 GiB (65,536
# tokens at 32 KiB a token): routed by prefix, a replica holds its half of the sessions; routed
# round-robin, each replica sees every session and holds about 60% of them. Requests carry no
# prompt_cache_key (--no-cache-fields): a session key would pin a session to one replica under
# either policy, and the point is the router's prefix index, fed by the replicas' KV events.
set -u
[ $# -gt 0 ] || { echo "usage: gpu_router.sh prepare|stage-a|stage-b|ROUND:table|smoke ..." >&2; exit 2; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
S=$(date -u +%Y%m%dT%H%M%SZ)
OUT=${OUT:-/tmp/router-out}
RAY_WHEEL=ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl
RAY_DEPS=(click msgpack protobuf jsonschema jsonschema-specifications referencing rpds-py attrs)
ie() { python3 -m inferengine.entrypoints.cli.main "$@"; }
workload=(--sessions 64 --turns 6 --prefix-len 2048 --shared-prefix-len 1024 --tool-len 200:400
          --output-len 128 --think-time 1 --think-distribution exponential --session-gap 0.25
          --max-active-sessions 32 --num-warmups 4 --no-cache-fields)
server="preset:inferengine --load-format dummy --max-model-len 8192 --data-parallel-size 2
        --kv-cache-memory 2GiB --disable-log-requests"
for item in "$@"; do
  case $item in
    prepare)  # here, with the network: Ray's wheel in two carried halves, its deps beside
      mkdir -p /tmp/raywhl .rayA .rayB/deps
      get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any "$@"; }
      get -d /tmp/raywhl "ray==2.60.0" && get -d .rayB/deps "${RAY_DEPS[@]}" || exit 1
      half=$(( $(stat -c %s /tmp/raywhl/$RAY_WHEEL) / 2 ))
      head -c "$half" /tmp/raywhl/$RAY_WHEEL > .rayA/p
      tail -c +$(( half + 1 )) /tmp/raywhl/$RAY_WHEEL > .rayB/p
      du -sh .rayA .rayB;;
    stage-a)
      mkdir -p /tmp/ray-parts && cp .rayA/p /tmp/ray-parts/a;;
    stage-b)
      cat /tmp/ray-parts/a .rayB/p > /tmp/ray-parts/$RAY_WHEEL && rm /tmp/ray-parts/a || exit 1
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site /tmp/ray-parts/$RAY_WHEEL .rayB/deps/*.whl || exit 1
      PYTHONPATH=/tmp/site python3 -c "import ray; print('ray', ray.__version__)";;
    *:table)
      round=${item%%:*}
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
      export PYTHONPATH=/tmp/site:$PWD
      aware="cache-aware=$server --router-policy cache-aware"
      rr="round-robin=$server --router-policy round-robin"
      systems=(--system "$aware" --system "$rr")
      name=$S-router-r$round
      mkdir -p /tmp/pr "$OUT"
      ie bench agent --model-dir configs/llama-3.2-1b --served-model-name llama-3.2-1b \
        "${workload[@]}" "${systems[@]}" --repeats 1 --start-repeat "$round" \
        --revision "${GIT_REV:-unknown}" --name router --out-dir "/tmp/pr/$name" 2>&1 | tail -30
      tar czf "$OUT/$name.tgz" -C /tmp/pr "$name";;
    smoke)
      export PYTHONPATH=$PWD
      tiny="preset:inferengine --load-format dummy --device cpu --max-model-len 256
            --data-parallel-size 2 --kv-cache-memory 32MiB --disable-log-requests"
      name=$S-router-smoke
      mkdir -p /tmp/pr
      ie bench agent --model-dir configs/smollm2-135m --served-model-name smollm2 \
        --system "cache-aware=$tiny --router-policy cache-aware" \
        --system "round-robin=$tiny --router-policy round-robin" \
        --sessions 5 --turns 2 --prefix-len 96 --shared-prefix-len 32 --tool-len 8:16 \
        --output-len 4 --think-time 0.2 --session-gap 0.1 --max-active-sessions 5 \
        --num-warmups 1 --no-cache-fields --revision "${GIT_REV:-unknown}" --name router-smoke \
        --out-dir "/tmp/pr/$name" 2>&1 | tail -25;;
    *) echo "unknown item $item: prepare, stage-a, stage-b, ROUND:table or smoke" >&2; exit 2;;
  esac
done
