# Sourced by the GPU-host benchmark scripts: unpack vLLM 0.26.0 (the staged /tmp/vllm-parts/part.00
# plus the carried .peer2) into /tmp/vllm-site and the server's wheels into /tmp/site, once per
# warm host; then put /tmp/site and the checkout on PYTHONPATH.
if [ ! -d /tmp/vllm-site/vllm ]; then
  mkdir -p /tmp/vllm-site
  cat /tmp/vllm-parts/part.00 .peer2/part.0* | xz -dc | tar x -C /tmp/vllm-site || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site .peer2/w/*.whl || exit 1
fi
# The MoE extension the stripped wheel drops, where gpu_paired.sh's third staging call left it.
if [ -f /tmp/vllm-parts/moe.so.xz ] && [ ! -f /tmp/vllm-site/vllm/_moe_C_stable_libtorch.abi3.so ]; then
  xz -dc /tmp/vllm-parts/moe.so.xz > /tmp/vllm-site/vllm/_moe_C_stable_libtorch.abi3.so || exit 1
fi
# vLLM validates any structured-output request through lm-format-enforcer's module, which its
# stripped site lacks: carry .whl (../shared/gpu/wheelhouse.sh lm-format-enforcer interegular).
if [ ! -d /tmp/vllm-site/lmformatenforcer ] && ls .whl/lm_format_enforcer-* >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site \
    .whl/lm_format_enforcer-* .whl/interegular-* || exit 1
fi
# vLLM's `--quantization` imports compressed-tensors (and it loguru), which the stripped site
# lacks: carry .whl with `pip download --no-deps compressed-tensors==0.17.0 loguru -d .whl`.
if [ ! -d /tmp/vllm-site/compressed_tensors ] && ls .whl/compressed_tensors-* >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/vllm-site \
    .whl/compressed_tensors-* .whl/loguru-* || exit 1
fi
if [ ! -d /tmp/site/llguidance ]; then  # our structured output (a dependency of ours)
  g=$(ls .whl/llguidance-* 2>/dev/null || ls .peer2/w/llguidance-*)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $g || exit 1
fi
# A newer fastapi left in /tmp/site by another script (0.165 imports opentelemetry, which the host
# lacks) fails our server at start-up: whatever is there must import, else .peer2's replaces it.
if ! PYTHONPATH=/tmp/site python3 -c "import fastapi" 2>/dev/null; then
  w=.peer2/w
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $w/annotated_types-* $w/fastapi-* $w/msgspec-* $w/pydantic-2* $w/pydantic_core-* $w/pyzmq-* $w/sniffio-* \
    $w/starlette-* $w/typing_inspection-* $w/uvicorn-* || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
