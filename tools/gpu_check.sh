#!/usr/bin/env bash
# Everything a GPU is needed for, in one call, from the source tree:
#   the GPU tests (tools/gpu_tests.py: parallel parts sharing the GPU),
#   compute-sanitizer memcheck on a subset (decode and prefill over shuffled pages,
#   and the HIP kernels, MFMA attention included, through the wave64 and MFMA emulations),
#   the bench of every group (JSON, for docs/measurements/<gpu>.json), the host's
#   cost a call (tools/host_overhead.py, SDPA's beside), the step group, and
#   transformers' caches beside kvcupy's (examples/transformers_generate.py).
# Logs and JSON go to $1 (default: the folder the environment variable OUT names,
# else ./gpu-check).
#
#   tools/gpu_check.sh [OUTPUT_DIR] [--quick | --tests K-L | --no-tests]
#
# --quick: the long-context error tests and the decode bench group only.
# FLASHINFER_BUNDLE=PATH: a tarball from tools/flashinfer_bundle.py, unpacked for the
#   step bench's FlashInfer rows (a machine without network access or nvcc).
# The tests run verbose: a part stopped by its time limit still names its failures.
# --tests K-L: only parts K to L of the GPU tests (of GPU_TEST_PARTS, default 24), nothing
#   else: the whole suite takes longer than one command may run, so it goes as
#   --tests 0-11, then --tests 12-23, then --no-tests (memcheck and the benches).
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-gpu-check}}
quick=${2:-}
mkdir -p "$results"
export PYTHONPATH=.
export KVCUPY_CACHE_DIR=${KVCUPY_CACHE_DIR:-/tmp/kvcupy-cache}
status=0

nvidia-smi -L | tee "$results/gpu.txt"

if [ "$quick" = "--quick" ]; then
    python3 -m pytest -q -m gpu tests/gpu/test_long_context_error.py >"$results/long-context.log" 2>&1 || status=1
    tail -3 "$results/long-context.log"
    python3 -m cli bench --backend cuda --groups decode --json >"$results/bench.json" 2>"$results/bench.log" || status=1
    tail -3 "$results/bench.log"
    exit $status
fi

if [ "$quick" = "--tests" ]; then
    python3 tools/gpu_tests.py --parts "${GPU_TEST_PARTS:-24}" --only "${3:?--tests takes K-L}" \
        --logs "$results/tests" --timeout 540 -- -m gpu -v -rfE tests >"$results/tests.log" 2>&1 || status=1
    tail -30 "$results/tests.log"
    exit $status
fi
if [ "$quick" != "--no-tests" ]; then
    python3 tools/gpu_tests.py --parts 12 --logs "$results/tests" --timeout 420 -- -m gpu -v -rfE tests \
        >"$results/tests.log" 2>&1 || status=1
    tail -30 "$results/tests.log"
fi

if command -v compute-sanitizer >/dev/null; then
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -m gpu \
        "tests/gpu/test_attention.py" -k "out_of_range_ids_never_fault" >"$results/memcheck.log" 2>&1 || status=1
    tail -3 "$results/memcheck.log"
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -m gpu \
        "tests/gpu/test_hip_emulation.py" --shard 0/8 >"$results/memcheck-hip.log" 2>&1 || status=1
    tail -3 "$results/memcheck-hip.log"
    compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -m gpu \
        "tests/gpu/test_hip_attention.py" -k "out_of_range or window_softcap_sinks or block_sizes_and_gqa" \
        >"$results/memcheck-hip-attention.log" 2>&1 || status=1
    tail -3 "$results/memcheck-hip-attention.log"
else
    echo "compute-sanitizer not found: memcheck skipped" | tee "$results/memcheck.log"
fi

python3 -m cli bench --backend cuda --json >"$results/bench.json" 2>"$results/bench.log" || status=1
tail -5 "$results/bench.log"
python3 tools/host_overhead.py --frameworks torch,cupy >"$results/host.json" 2>"$results/host.log" || status=1
cat "$results/host.json"
step_env=()
if [ -n "${FLASHINFER_BUNDLE:-}" ]; then
    # The bundle's modules only: a missing one fails by name instead of compiling.
    mkdir -p /tmp/kvcupy-flashinfer && tar -xJf "$FLASHINFER_BUNDLE" -C /tmp/kvcupy-flashinfer
    step_env=(PYTHONPATH="/tmp/kvcupy-flashinfer:$PYTHONPATH" FLASHINFER_DISABLE_JIT=1)
fi
env "${step_env[@]}" python3 -m cli bench --backend cuda --groups step --json \
    >"$results/step.json" 2>"$results/step.log" || status=1
tail -3 "$results/step.log"
# Llama-3-8B's geometry, 4 layers of random weights; each batch and prompt length in
# its own process (needs transformers, and hqq / optimum-quanto for those rows).
for shape in "1 1024" "1 8192" "16 1024" "16 8192"; do
    set -- $shape
    python3 examples/transformers_generate.py --model random:llama-3-8b --layers 4 --batch "$1" \
        --prompt-len "$2" --new-tokens 256 --repeat 2 --json \
        --caches dynamic,int4_per_token_head,int8_per_token_head,fp8_per_token_head,hqq:4,quanto:4 \
        >"$results/transformers-b$1-p$2.json" 2>>"$results/transformers.log" || status=1
done
exit $status
