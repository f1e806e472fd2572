#!/usr/bin/env bash
# The GPU kit (issue 19): bash bench/gpu/run.sh [--dry] [--part a|b|all] [--hardware TOML] ...
# On the device: installs the carried .whl/ (see wheels.txt) under /tmp/site, then runs
# bench/gpu/kit.py, which writes $OUT/gpu.json, $OUT/summary.md and the measured hardware TOML;
# the whole log goes to $OUT/kit.log. --dry (CI, no GPU) installs nothing.
set -uo pipefail
cd "$(dirname "$0")/../.."
export OUT="${OUT:-$PWD/out/gpu}"
mkdir -p "$OUT"
dry=0
for arg in "$@"; do [ "$arg" = "--dry" ] && dry=1; done
PY=${PYTHON:-python3}
if [ "$dry" = 0 ]; then
    start=$(date +%s)
    ls .whl/*.whl >/dev/null 2>&1 || { echo "no .whl/: run bash bench/gpu/fetch_wheels.sh here and carry .whl"; exit 2; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 2
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    # libaio for DeepSpeed's async_io op (ZeRO-Infinity), unpacked beside /, never into it
    mkdir -p /tmp/aio
    for deb in .whl/*.deb; do [ -f "$deb" ] && dpkg -x "$deb" /tmp/aio; done
    lib=/tmp/aio/usr/lib/x86_64-linux-gnu
    export CPATH=/tmp/aio/usr/include${CPATH:+:$CPATH}
    export LIBRARY_PATH=$lib${LIBRARY_PATH:+:$LIBRARY_PATH} LD_LIBRARY_PATH=$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export CFLAGS="-I/tmp/aio/usr/include ${CFLAGS:-}" LDFLAGS="-L$lib ${LDFLAGS:-}"
    # the image's TORCH_CUDA_ARCH_LIST names arch-specific targets ("9.0a"), which DeepSpeed's JIT builder
    # cannot parse (op_builder/builder.py compute_capability_args: int("0a")); its ops need no sm_90a code
    export TORCH_CUDA_ARCH_LIST=$(echo "${TORCH_CUDA_ARCH_LIST:-}" | sed -E 's/([0-9])a\b/\1/g')
    [ -z "$TORCH_CUDA_ARCH_LIST" ] && unset TORCH_CUDA_ARCH_LIST
    # DeepSpeed ships only an sdist: build it here with its ops left to the JIT (ninja is in the image)
    DS_BUILD_OPS=0 $PY -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site \
        .whl/deepspeed-*.tar.gz || echo "deepspeed did not install: the DeepSpeed steps will fail and say so"
    echo "installed the carried packages in $(( $(date +%s) - start )) s"
fi
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 $PY bench/gpu/kit.py "$@" 2>&1 | tee "$OUT/kit.log"
