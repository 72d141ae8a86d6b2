#!/usr/bin/env bash
# Everything a GPU is needed for, from the source tree, in stages:
#   tests         the GPU tests (tools/gpu_tests.py: GPU_TEST_PARTS parallel parts, default 24,
#                 sharing the GPU); tests:K-L runs parts K to L only
#   memcheck      compute-sanitizer memcheck on a subset: decode and prefill over shuffled
#                 pages, and the HIP kernels, MFMA attention included, through the wave64 and
#                 MFMA emulations
#   bench         the bench of every default group (JSON, for docs/measurements/<gpu>.json)
#   host          the host's cost a call (tools/host_overhead.py, SDPA's beside)
#   step          the step group; FLASHINFER_BUNDLE=PATH (a tarball from
#                 tools/flashinfer_bundle.py) gives it FlashInfer's rows on a machine without
#                 network access or nvcc
#   transformers  transformers' caches beside kvcupy's (examples/transformers_generate.py)
#   quick         the long-context error tests and the decode bench group alone
#   compare       the bench of another checkout (the folder BASELINE names, e.g. from
#                 `git archive REV | tar -x -C DIR`) and of this one, in the order this,
#                 baseline, baseline, this, after both have compiled their kernels side by
#                 side; tools/bench_compare.py then compares each kvcupy case's mean time
# Logs and JSON go to OUTPUT_DIR (default: the folder the environment variable OUT names,
# else ./gpu-check).
#
#   tools/gpu_check.sh [OUTPUT_DIR] [STAGE,STAGE,...]    (default: every stage but quick and compare)
#
# Where one command may run ten minutes, the whole goes in four: tests:0-11, tests:12-23,
# memcheck,bench,host, then step,transformers.
set -uo pipefail
cd "$(dirname "$0")/.."
results=${1:-${OUT:-gpu-check}}
stages=${2:-tests,memcheck,bench,host,step,transformers}
export PYTHONPATH=.
export KVCUPY_CACHE_DIR=${KVCUPY_CACHE_DIR:-/tmp/kvcupy-cache}
status=0

known="tests memcheck bench host step transformers quick compare"
for stage in ${stages//,/ }; do
    if [[ " $known " != *" ${stage%%:*} "* ]]; then
        echo "unknown stage '$stage' (stages: ${known// /, }; tests:K-L for some parts)" >&2
        exit 2
    fi
    if [ "$stage" = compare ] && [ ! -f "${BASELINE:-}/cli/__main__.py" ]; then
        echo "the compare stage needs BASELINE: a folder holding another kvcupy checkout (BASELINE='${BASELINE:-}')" >&2
        exit 2
    fi
done
mkdir -p "$results"
results=$(cd "$results" && pwd)   # (the compare stage writes from the other checkout's folder too)
nvidia-smi -L | tee "$results/gpu.txt"

run_tests() {   # $1: the parts to run (K-L), or empty for every part
    local only=()
    [ -n "$1" ] && only=(--only "$1")
    # Verbose: a part stopped by its time limit still names its failures.
    python3 tools/gpu_tests.py --parts "${GPU_TEST_PARTS:-24}" "${only[@]}" --logs "$results/tests" \
        --timeout 540 -- -m gpu -v -rfE tests >"$results/tests${1:+-$1}.log" 2>&1 || status=1
    tail -30 "$results/tests${1:+-$1}.log"
}

run_memcheck() {
    if ! command -v compute-sanitizer >/dev/null; then
        echo "compute-sanitizer not found: memcheck skipped" | tee "$results/memcheck.log"
        return
    fi
    local name selection
    for name in memcheck memcheck-hip memcheck-hip-attention; do
        case $name in
            memcheck) selection=(tests/gpu/test_attention.py -k "out_of_range_ids_never_fault") ;;
            memcheck-hip) selection=(tests/gpu/test_hip_emulation.py --shard 0/8) ;;
            memcheck-hip-attention) selection=(tests/gpu/test_hip_attention.py
                                               -k "out_of_range or window_softcap_sinks or block_sizes_and_gqa") ;;
        esac
        compute-sanitizer --tool memcheck --error-exitcode 1 python3 -m pytest -q -m gpu "${selection[@]}" \
            >"$results/$name.log" 2>&1 || status=1
        tail -3 "$results/$name.log"
    done
}

run_step() {
    local step_env=()
    if [ -n "${FLASHINFER_BUNDLE:-}" ]; then
        # The bundle's modules only: a missing one fails by name instead of compiling.
        mkdir -p /tmp/kvcupy-flashinfer && tar -xJf "$FLASHINFER_BUNDLE" -C /tmp/kvcupy-flashinfer
        step_env=(PYTHONPATH="/tmp/kvcupy-flashinfer:$PYTHONPATH" FLASHINFER_DISABLE_JIT=1)
    fi
    env "${step_env[@]}" python3 -m cli bench --backend cuda --groups step --json \
        >"$results/step.json" 2>"$results/step.log" || status=1
    tail -3 "$results/step.log"
}

run_transformers() {
    # Llama-3-8B's geometry, 4 layers of random weights; each batch and prompt length in
    # its own process (needs transformers, and hqq / optimum-quanto for those rows).
    local shape
    for shape in "1 1024" "1 8192" "16 1024" "16 8192"; do
        set -- $shape
        python3 examples/transformers_generate.py --model random:llama-3-8b --layers 4 --batch "$1" \
            --prompt-len "$2" --new-tokens 256 --repeat 2 --json \
            --caches dynamic,int4_per_token_head,int8_per_token_head,fp8_per_token_head,hqq:4,quanto:4 \
            >"$results/transformers-b$1-p$2.json" 2>>"$results/transformers.log" || status=1
    done
}

run_compare() {
    local baseline side run quick=(--rounds 1 --repeats 1 --prefill-repeats 1 --warmup 0)
    baseline=$(cd "$BASELINE" && pwd)
    # Compiling is most of a first run: both trees at once, untimed.
    for side in "$baseline" "$PWD"; do
        (cd "$side" && PYTHONPATH=. python3 -m cli bench --backend cuda --json "${quick[@]}" >/dev/null \
            2>>"$results/compare.log") &
    done
    wait
    for run in this-1 baseline-1 baseline-2 this-2; do
        side=$PWD
        [[ $run == baseline-* ]] && side=$baseline
        (cd "$side" && PYTHONPATH=. python3 -m cli bench --backend cuda --json >"$results/compare-$run.json" \
            2>>"$results/compare.log") || status=1
    done
    python3 tools/bench_compare.py "$results/compare-baseline-1.json" "$results/compare-this-1.json" \
        "$results/compare-baseline-2.json" "$results/compare-this-2.json" | tee "$results/compare.txt" || status=1
}

for stage in ${stages//,/ }; do
    case $stage in
        tests) run_tests "" ;;
        tests:*) run_tests "${stage#tests:}" ;;
        memcheck) run_memcheck ;;
        bench)
            python3 -m cli bench --backend cuda --json >"$results/bench.json" 2>"$results/bench.log" || status=1
            tail -5 "$results/bench.log" ;;
        host)
            python3 tools/host_overhead.py --frameworks torch,cupy >"$results/host.json" 2>"$results/host.log" \
                || status=1
            cat "$results/host.json" ;;
        step) run_step ;;
        transformers) run_transformers ;;
        quick)
            python3 -m pytest -q -m gpu tests/gpu/test_long_context_error.py >"$results/long-context.log" 2>&1 \
                || status=1
            tail -3 "$results/long-context.log"
            python3 -m cli bench --backend cuda --groups decode --json >"$results/bench-decode.json" \
                2>"$results/bench-decode.log" || status=1
            tail -3 "$results/bench-decode.log" ;;
        compare) run_compare ;;
    esac
done
exit $status
