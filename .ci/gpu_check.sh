#!/usr/bin/env bash
# The one script to run on a GPU machine: the CUDA cases of the test suite (the full tier; see
# GPU_TESTS below), then the benchmark, then a short summary. Run from anywhere; it works in the repository root.
#
#   .ci/gpu_check.sh                    # tests, then benchmark
#   .ci/gpu_check.sh tests-only         # tests only
#   .ci/gpu_check.sh bench-only         # benchmark only
#   .ci/gpu_check.sh bench-only --layers 4 --peers resident offtensor   # extra args go to the bench
#
# Logs and results go to $OUT (default: /tmp/offtensor_gpu_check): pytest.log, bench.log, bench.json.
# The tests run are the CUDA cases (marker `cuda`): the CPU cases are what CI (.ci/run) runs, and
# running them here too doubled the time (over 400 s on one H200). GPU_TESTS=all runs both.
# Wheels in .whl/ (packages the GPU machine lacks, e.g. diffusers) are installed to /tmp/site
# first. Each stage runs under a time limit (PYTEST_TIMEOUT, BENCH_TIMEOUT seconds) so that one
# hung stage still leaves the other's logs and a summary.
set -o pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

mode=all
case "${1:-}" in
    all|tests-only|bench-only) mode=$1; shift ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    "") ;;
    -*) ;;  # bench arguments with the default mode
    *) echo "gpu_check: unknown mode '$1' (all, tests-only, bench-only)" >&2; exit 2 ;;
esac

OUT=${OUT:-${TMPDIR:-/tmp}/offtensor_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# Every case of every test matrix, CUDA cases included (tests/tiers.py); OFFTENSOR_TESTS=quick
# in the environment runs the quick sample instead.
export OFFTENSOR_TESTS=${OFFTENSOR_TESTS:-full}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1

if [ "$mode" = all ]; then
    PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-240}
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-300}
else
    PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-540}
    BENCH_TIMEOUT=${BENCH_TIMEOUT:-540}
fi

if compgen -G ".whl/*.whl" > /dev/null; then
    echo "gpu_check: installing $(ls .whl/*.whl | xargs -n1 basename | tr '\n' ' ')"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
export PYTHONPATH=.:${PYTHONPATH:-}

nvidia-smi -L || echo "gpu_check: nvidia-smi failed"
python3 -c 'import torch; print(f"torch {torch.__version__}, cuda {torch.version.cuda}, "
                                 f"devices {torch.cuda.device_count()}")'

case "${GPU_TESTS:-cuda}" in
    cuda) marks="cuda" ;;
    all) marks="cuda or not cuda" ;;
    *) echo "gpu_check: GPU_TESTS must be cuda or all, not '${GPU_TESTS}'" >&2; exit 2 ;;
esac

test_rc=skipped
bench_rc=skipped

if [ "$mode" != bench-only ]; then
    echo "gpu_check: pytest (limit ${PYTEST_TIMEOUT}s)"
    timeout --signal=INT --kill-after=20 "$PYTEST_TIMEOUT" \
        python3 -m pytest -q -rf tests -m "$marks" 2>&1 | tee "$OUT/pytest.log"
    test_rc=$?
fi

if [ "$mode" != tests-only ]; then
    echo "gpu_check: benchmark (limit ${BENCH_TIMEOUT}s)"
    timeout --signal=INT --kill-after=20 "$BENCH_TIMEOUT" \
        python3 -m benchmarks --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log"
    bench_rc=$?
fi

echo
echo "================ gpu_check summary ================"
if [ "$test_rc" != skipped ]; then
    # pytest -q ends with a line such as "12 passed, 1 skipped in 3.4s".
    line=$(grep -E '[0-9]+ (passed|failed|error|errors|skipped|deselected)|no tests ran' "$OUT/pytest.log" | tail -n 1)
    grep -E '^(FAILED|ERROR) ' "$OUT/pytest.log" | cut -c1-240 | head -n 40
    echo "pytest (exit $test_rc): ${line:-no summary line; see pytest.log}"
    [ "$test_rc" = 124 ] && echo "pytest: stopped after ${PYTEST_TIMEOUT}s"
fi
if [ "$bench_rc" != skipped ]; then
    echo "bench (exit $bench_rc):"
    [ "$bench_rc" = 124 ] && echo "bench: stopped after ${BENCH_TIMEOUT}s"
    # The benchmark prints its table last, after a blank line: show that last paragraph.
    awk 'BEGIN { RS = "" } { last = $0 } END { print last }' "$OUT/bench.log"
fi

rc=0
for code in "$test_rc" "$bench_rc"; do
    if [ "$code" != skipped ] && [ "$code" != 0 ]; then rc=1; fi
done
exit "$rc"
