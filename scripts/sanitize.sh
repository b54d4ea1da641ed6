#!/usr/bin/env bash
# Every GPU kernel under NVIDIA's compute-sanitizer (issue 16), on the GPU machine.
#
#   bash scripts/sanitize.sh TOOL tests [test_matvec test_attention ...]   kernels' GPU tests
#   bash scripts/sanitize.sh TOOL steps [ARCHS [DTYPES]]                    a prefill + a token step
#   bash scripts/sanitize.sh TOOL all                                       both, every one
#
# TOOL: memcheck, racecheck, synccheck or initcheck (or a comma-separated list of them).
# tests: PYCALM_TEST_GPU=1 pytest over each kernel's test file (default: every one present), one
#   sanitizer run a file. steps: scripts/sanitize_step.py, one prefill chunk and one token step of
#   each architecture (default llama,qwen2,mistral,mixtral) and weight format (default every one
#   of pycalm.model.config.WEIGHT_DTYPES) at tiny shapes, one sanitizer run an architecture.
# Each run prints its summary line ("ERROR SUMMARY: 0 errors", "RACECHECK SUMMARY: 0 hazards
# displayed ...") after its name; the full output goes to $OUT/sanitize-TOOL-NAME.log. The exit
# code is non-zero if any run found an error or failed.
#
# The sanitizer slows kernels 10-100x: split the work so that each call stays within a few
# minutes, e.g. `sanitize.sh memcheck tests test_matvec test_qkv` then the next files.
# SANITIZE_GPUS=0,1,2,... runs them in parallel, one lane a GPU taking the next run from a shared
# queue (a multi-GPU machine finishes the whole sweep in one call); with SANITIZE_UNTIL=SECONDS
# the lanes start no run after that many seconds, and the runs left are listed as not run.
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
usage="usage: sanitize.sh TOOL tests|steps|all [ITEMS...]"
tools=${1:?$usage}; group=${2:?$usage}
shift 2

KERNEL_TESTS=(test_prefill_attention test_matmul test_moe_rows test_rows test_tensorcore test_attention test_matvec
  test_qkv test_moe test_sample test_embed test_common)  # longest first; each launches kernels

runs=()  # "name|command"
add_tests() {
  local files=("$@") f; [ ${#files[@]} -eq 0 ] && files=("${KERNEL_TESTS[@]}")
  for f in "${files[@]}"; do
    f=${f%.py}; f=${f#tests/}
    [ -f "tests/$f.py" ] || { echo "no tests/$f.py"; exit 2; }
    runs+=("$f|env PYCALM_TEST_GPU=1 python3 -m pytest -q -n 0 -p no:cacheprovider tests/$f.py ${SANITIZE_PYTEST_ARGS:-}")
  done
}
add_steps() {
  local archs=${1:-llama,qwen2,mistral,mixtral} dtypes=${2:-} graph="" arch
  [ "${SANITIZE_GRAPH:-0}" = 1 ] && graph="--graph"
  for arch in ${archs//,/ }; do
    runs+=("step-$arch|python3 scripts/sanitize_step.py --archs $arch ${dtypes:+--dtypes $dtypes} $graph")
  done
}
case $group in
  tests) add_tests "$@" ;;
  steps) add_steps "$@" ;;
  all) add_steps; add_tests ;;
  *) echo "unknown group $group (tests, steps or all)"; exit 2 ;;
esac

jobs=()  # "tool|name|command", in the order of the items given (put the longest first)
for run in "${runs[@]}"; do
  for tool in ${tools//,/ }; do jobs+=("$tool|$run"); done
done

run_one() {  # tool|name|command -> one result line; exit status 1 on an error or a failure
  local tool=${1%%|*} rest=${1#*|}; local name=${rest%%|*} cmd=${rest#*|}
  local log="$out/sanitize-$tool-$name.log" start rc summary tests steps
  start=$(date +%s)
  # eval: cmd is a shell word list (SANITIZE_PYTEST_ARGS may quote a -k expression)
  eval "$sanitizer --tool $tool --error-exitcode 1 --print-limit 20 $cmd" > "$log" 2>&1
  rc=$?
  summary=$(grep -E "(ERROR|RACECHECK|SYNCCHECK|INITCHECK) SUMMARY" "$log" | tail -1 | sed 's/^=* *//')
  tests=$(grep -E "^[0-9]+ (passed|failed)|(passed|failed|skipped) in " "$log" | tail -1)
  steps=$(grep -c "^sanitize_step .* ok:" "$log")
  [ "${name#step-}" != "$name" ] && tests="$steps cases ok$(grep -c '^sanitize_step .* FAIL:' "$log" | sed 's/^0$//; s/^[1-9].*/, & FAILED/')"
  echo "$tool $name ($(( $(date +%s) - start )) s, rc $rc${CUDA_VISIBLE_DEVICES:+, GPU $CUDA_VISIBLE_DEVICES}): ${summary:-no summary line} | ${tests:-?}"
  [ $rc -eq 0 ] || { grep -E "^(=========|FAILED|sanitize_step .* FAIL)" "$log" | head -12; return 1; }
}

status=0
if [ -z "${SANITIZE_GPUS:-}" ]; then
  for job in "${jobs[@]}"; do run_one "$job" || status=1; done
  exit $status
fi
# SANITIZE_GPUS=0,1,...: one lane a GPU, each taking the next run from a shared queue (flock)
until=$(( $(date +%s) + ${SANITIZE_UNTIL:-0} ))
queue=$(mktemp); printf '%s\n' "${jobs[@]}" > "$queue"; failed=$(mktemp)
lane() {
  local job
  while :; do
    [ -n "${SANITIZE_UNTIL:-}" ] && [ "$(date +%s)" -ge "$until" ] && return 0
    job=$(flock "$queue.lock" sh -c 'head -n 1 "$1"; sed -i 1d "$1"' _ "$queue")
    [ -n "$job" ] || return 0
    CUDA_VISIBLE_DEVICES=$1 run_one "$job" || echo "$job" >> "$failed"
  done
}
for gpu in ${SANITIZE_GPUS//,/ }; do lane "$gpu" & done
wait
while IFS= read -r job; do  # left in the queue by SANITIZE_UNTIL
  rest=${job#*|}; echo "${job%%|*} ${rest%%|*}: not run (SANITIZE_UNTIL)"; status=1
done < "$queue"
[ -s "$failed" ] && status=1
rm -f "$queue" "$queue.lock" "$failed"
exit $status
