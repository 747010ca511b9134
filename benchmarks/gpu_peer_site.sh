# Sourced by the GPU-host benchmark scripts: unpack vLLM 0.26.0 (the staged /tmp/vllm-parts/part.00
# plus the carried .peer2) into /tmp/vllm-site and the server's wheels into /tmp/site, once per
# warm host; then put /tmp/site and the checkout on PYTHONPATH.
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
