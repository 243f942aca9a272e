#!/usr/bin/env bash
# The one prepared script of a session lent a GPU (issue 44): 15 device-minutes in all, one call of at most
# 600 s. Sets up the offline kit (../shared/gpu-kit/README.md: carry .gpu-kit), then runs, in priority order,
# each step under `timeout` within a global deadline: a step that no longer fits is skipped, never killed
# mid-write (attnbench's runs are given a --budget and stopped by SIGINT, which ends them cleanly). Everything
# goes to one folder, packed after each step into $OUT/gpu-session.tar.gz (the device tool brings back at most
# 8 files), beside the log $OUT/gpu-session.log. The call (docs/performance.md, "The next GPU session's script"):
#
#   bash scripts/gpu-session.sh prepare           # here: the kit copied into .gpu-kit, which the call carries
#   bash scripts/gpu-session.sh [DEADLINE_S]     # there: default 570, the seconds from start within which it ends
#
# Environment: GPU_SESSION_STEPS (the steps to run, in order; default all: kernels variants fla-kernels
# quick-sweeps lm, then the report), GPU_SESSION_DRY=1 (print the plan and each command, run nothing),
# GPU_SESSION_COMMIT (the checkout's commit, written to the pack's README: the device copy has no .git),
# OUT (default results/gpu-session-<UTC time>).
set -uo pipefail
cd "$(dirname "$0")/.."

# Here, before the call: `bash scripts/gpu-session.sh prepare` copies the kit into .gpu-kit (ignored by git) to carry
if [ "${1:-}" = prepare ]; then
  mkdir -p .gpu-kit .git/info &&
    cp -r "${GPU_KIT:-../shared/gpu-kit}/wheels-cp312" "${GPU_DATA:-../shared/data}/wikitext-2" .gpu-kit/ || exit 1
  grep -qx '/.gpu-kit/' .git/info/exclude 2> /dev/null || echo '/.gpu-kit/' >> .git/info/exclude
  echo "gpu-session: .gpu-kit ready ($(du -sh .gpu-kit | cut -f1)); the call: command" \
    "'GPU_SESSION_COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu-session.sh 570', carry ['.gpu-kit'], timeout_s 600"
  exit 0
fi

DEADLINE_S=${1:-570}
STEPS=${GPU_SESSION_STEPS:-kernels variants fla-kernels quick-sweeps lm}
DRY=${GPU_SESSION_DRY:-0}
OUT=${OUT:-results/gpu-session-$(date -u +%Y%m%dT%H%M%SZ)}
WORK=${GPU_SESSION_WORK:-/tmp/gpu-session}
RESULTS=$WORK/results
PYTHON=${PYTHON:-python3}
# what the report and the pack need at the end, kept out of every step's time (and the 20 s a step may take to stop)
RESERVE_S=45
# dry mode: a clock that each step moves on by its allotted seconds, so the plan shows what the deadline would skip
SIMULATED=0
now() { echo $(( $(date +%s) + SIMULATED )); }
START=$(now)

# step name -> planned seconds (docs/performance.md's measured figures and the cost model, H100/H200),
# the least time worth starting it with, and what it runs
declare -A PLAN=([setup]=30 [kernels]=170 [variants]=310 [fla-kernels]=430 [quick-sweeps]=400 [lm]=420)
declare -A LEAST=([setup]=0 [kernels]=170 [variants]=60 [fla-kernels]=60 [quick-sweeps]=60 [lm]=60)
declare -A WHAT=(
  [setup]="the kit's wheels (pydantic, fla-core) and attnbench, offline"
  [kernels]="the kernel tests compiled natively, 8 pytest processes (140 tests: 156 s on the H200, 2026-12-04)"
  [variants]="cuda-variants --preset quick: every core variant, torch and triton, fwd/train/decode, fp32/bf16 (cost model 282 s)"
  [fla-kernels]="kernels-vs-fla --preset done-when: our Triton kernels beside fla (cost model 428 s; fla's first uses 53-60 s each)"
  [quick-sweeps]="the gpu-quick presets of seq-sweep, d-dot-sweep, decode, paper-small-lm (cost model 200 + 46 + 94 + 37 s)"
  [lm]="paper-small-lm --preset gpu (51 s) and quality/lm-wikitext --preset gpu (10 variants, 200 steps each)"
)

left() { echo $((DEADLINE_S - ($(now) - START))); }
say() { echo "gpu-session [$(($(now) - START)) s]: $*" | tee -a "$LOG"; }
# run (or in dry mode print) a command under timeout: SIGINT first (attnbench and pytest end cleanly on it), KILL 20 s later
bounded() {
  local seconds=$1; shift
  echo "+ timeout -s INT -k 20 $seconds $*" >> "$LOG"
  if [ "$DRY" = 1 ]; then echo "  timeout -s INT -k 20 $seconds $*"; return 0; fi
  timeout -s INT -k 20 "$seconds" "$@" >> "$LOG" 2>&1
}
# attnbench run of SCENARIO with PRESET within SECONDS: --budget picks the cells that fit (it lists the rest)
run_scenario() {
  local seconds=$1 scenario=$2 preset=$3; shift 3
  if [ ! -e "scenarios/$scenario.yaml" ]; then say "skipped $scenario: scenarios/$scenario.yaml is missing"; return 0; fi
  if ! grep -q "^  $preset:" "scenarios/$scenario.yaml"; then say "skipped $scenario: it has no preset $preset"; return 0; fi
  if [ "$seconds" -lt 40 ]; then say "skipped $scenario --preset $preset: $seconds s left in the step"; return 0; fi
  bounded "$seconds" "$PYTHON" -m harness.cli run "$scenario" --preset "$preset" --budget "$((seconds > 40 ? seconds - 20 : 20))s" \
    --out "$RESULTS" --no-progress "$@"
}
pack() {
  [ "$DRY" = 1 ] && return 0
  tar -czf "$OUT/gpu-session.tar.gz.part" -C "$(dirname "$WORK")" "$(basename "$WORK")" && mv "$OUT/gpu-session.tar.gz.part" "$OUT/gpu-session.tar.gz"
}

step_setup() {
  bounded 120 "$PYTHON" -m pip install -q --no-index --find-links .gpu-kit/wheels-cp312 pydantic fla-core &&
    bounded 120 "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation -e .
}
step_kernels() {
  local workers=(-n 8)  # pytest-xdist; one process without it
  [ "$DRY" = 1 ] || "$PYTHON" -c "import xdist" 2> /dev/null || workers=()
  bounded "$1" env ATTNBENCH_TEST_DEVICE=cuda "$PYTHON" -m pytest tests/test_kernels -m "not slow" "${workers[@]}" -q -p no:cacheprovider \
    --junitxml="$WORK/kernel-tests.xml"
}
step_variants() { run_scenario "$1" cuda-variants quick; }
step_fla_kernels() { run_scenario "$1" kernels-vs-fla done-when; }
# the smaller scenarios first, each with what is left of the step: --budget ends each at its cells' estimate
step_quick_sweeps() {
  local end=$(($(now) + $1)) scenario
  for scenario in paper-small-lm d-dot-sweep decode seq-sweep; do run_scenario $((end - $(now))) "$scenario" gpu-quick; done
}
step_lm() {
  local end=$(($(now) + $1))
  run_scenario $((end - $(now) < 90 ? end - $(now) : 90)) paper-small-lm gpu
  run_scenario $((end - $(now))) quality/lm-wikitext gpu
}

mkdir -p "$OUT" "$WORK" "$RESULTS"
LOG=$OUT/gpu-session.log
: > "$LOG"
export PYTHONUNBUFFERED=1 ATTNBENCH_DATA=$PWD/.gpu-kit
say "deadline ${DEADLINE_S} s; results in $WORK, packed into $OUT/gpu-session.tar.gz$([ "$DRY" = 1 ] && echo '; dry run: nothing runs')"
for step in setup $STEPS; do
  [ -n "${PLAN[$step]:-}" ] || { say "unknown step $step (known: ${!PLAN[*]})"; exit 2; }
  say "plan: $step ${PLAN[$step]} s: ${WHAT[$step]}"
done
{
  echo "commit: ${GPU_SESSION_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "command: bash scripts/gpu-session.sh $DEADLINE_S (GPU_SESSION_STEPS='$STEPS')"
  [ "$DRY" = 1 ] || { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader; "$PYTHON" -V; }
} > "$WORK/session.txt" 2>&1

for step in setup $STEPS; do
  budget=$(( $(left) - RESERVE_S ))
  planned=${PLAN[$step]} least=${LEAST[$step]}
  seconds=$(( planned < budget ? planned : budget ))
  if [ "$seconds" -lt "$least" ] || [ "$seconds" -le 0 ]; then
    say "skipped $step: ${budget} s left before the report, it needs ${least} s"
    continue
  fi
  say "start $step (${seconds} s of $budget s left)"
  "step_${step//-/_}" "$seconds"
  code=$?
  [ "$DRY" = 1 ] && SIMULATED=$((SIMULATED + seconds))
  say "end $step: exit code $code"
  [ "$step" = setup ] && [ "$DRY" != 1 ] && ! "$PYTHON" -c "import pydantic, harness" 2>> "$LOG" && { say "setup failed: see the log"; pack; exit 1; }
  pack
done
say "start report"
if [ "$DRY" = 1 ] || ls "$RESULTS"/*.jsonl > /dev/null 2>&1; then
  bounded $(( $(left) > 20 ? $(left) - 10 : 10 )) "$PYTHON" -m harness.cli report "$RESULTS" -o "$WORK/report"
else
  say "no results to report"
fi
cp "$LOG" "$WORK/"
pack
say "done: $OUT/gpu-session.tar.gz"
