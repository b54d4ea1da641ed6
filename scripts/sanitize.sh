#!/usr/bin/env bash
# Every GPU kernel under NVIDIA's compute-sanitizer (issue 16), on the GPU machine.
#
#   bash scripts/sanitize.sh TOOL tests [test_matvec test_attention ...]   kernels' GPU tests
#   bash scripts/sanitize.sh TOOL steps [ARCHS [DTYPES]]                    a prefill + a token step
#
# TOOL: memcheck, racecheck, synccheck or initcheck (or a comma-separated list of them).
# tests: PYCALM_TEST_GPU=1 pytest over each kernel's test file (default: every one present), one
#   sanitizer run a file. steps: scripts/sanitize_step.py, one prefill chunk and one token step of
#   each architecture (default llama,qwen2,mistral,mixtral) and weight format (default every one
#   of pycalm.config.WEIGHT_DTYPES) at tiny shapes, one sanitizer run an architecture.
# Each run prints its summary line ("ERROR SUMMARY: 0 errors", "RACECHECK SUMMARY: 0 hazards
# displayed ...") after its name; the full output goes to $OUT/sanitize-TOOL-NAME.log. The exit
# code is non-zero if any run found an error or failed.
#
# The sanitizer slows kernels 10-100x: split the work so that each call stays within a few
# minutes, e.g. `sanitize.sh memcheck tests test_matvec test_qkv` then the next files.
# pytest needs -n 0 (no xdist workers) under the sanitizer. The kernel cache stays on: the
# sanitizer instruments each module as the driver loads it, from a cached cubin as from a fresh
# one. sanitize_step.py runs the token step as plain launches (a report then names one kernel
# launch), with --graph (SANITIZE_GRAPH=1) as the captured graph. SANITIZE_PYTEST_ARGS adds
# pytest arguments (e.g. "-k 'not realistic'" to leave out the large shapes).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-out}; mkdir -p "$out"
if [ ! -d /tmp/site ] && ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
sanitizer=${SANITIZER:-/usr/local/cuda/bin/compute-sanitizer}
tools=${1:?usage: sanitize.sh TOOL tests|steps [ITEMS...]}; group=${2:?usage: sanitize.sh TOOL tests|steps [ITEMS...]}
shift 2

KERNEL_TESTS=(test_common test_matvec test_qkv test_attention test_sliding_window test_embed test_norm
  test_sample test_moe test_moe_rows test_matmul test_tensorcore test_rows test_prefill_attention)

runs=()  # "name|command"
case $group in
  tests)
    files=("$@"); [ ${#files[@]} -eq 0 ] && files=("${KERNEL_TESTS[@]}")
    for f in "${files[@]}"; do
      f=${f%.py}; f=${f#tests/}
      [ -f "tests/$f.py" ] || { echo "no tests/$f.py"; exit 2; }
      runs+=("$f|env PYCALM_TEST_GPU=1 python3 -m pytest -q -n 0 -p no:cacheprovider tests/$f.py ${SANITIZE_PYTEST_ARGS:-}")
    done ;;
  steps)
    archs=${1:-llama,qwen2,mistral,mixtral}; dtypes=${2:-}
    graph=""; [ "${SANITIZE_GRAPH:-0}" = 1 ] && graph="--graph"
    for arch in ${archs//,/ }; do
      runs+=("step-$arch|python3 scripts/sanitize_step.py --archs $arch ${dtypes:+--dtypes $dtypes} $graph")
    done ;;
  *) echo "unknown group $group (tests or steps)"; exit 2 ;;
esac

status=0
for tool in ${tools//,/ }; do
  for run in "${runs[@]}"; do
    name=${run%%|*}; cmd=${run#*|}
    log="$out/sanitize-$tool-$name.log"
    start=$(date +%s)
    # eval: cmd is a shell word list (SANITIZE_PYTEST_ARGS may quote a -k expression)
    eval "$sanitizer --tool $tool --error-exitcode 1 --print-limit 20 $cmd" > "$log" 2>&1
    rc=$?
    summary=$(grep -E "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
    tests=$(grep -E "^[0-9]+ (passed|failed)|(passed|failed|skipped) in " "$log" | tail -1)
    steps=$(grep -c "^sanitize_step .* ok:" "$log")
    [ "$group" = steps ] && tests="$steps cases ok$(grep -c '^sanitize_step .* FAIL:' "$log" | sed 's/^0$//; s/^[1-9].*/, & FAILED/')"
    echo "$tool $name ($(( $(date +%s) - start )) s, rc $rc): ${summary:-no summary line} | ${tests:-?}"
    [ $rc -ne 0 ] && { status=1; grep -E "^(=========|FAILED|sanitize_step .* FAIL)" "$log" | head -12; }
  done
done
exit $status
