#!/usr/bin/env bash
# Sweep methods x budgets on one benchmark, one run after another, then summarize.
#   METHODS="snapkv h2o" BUDGETS="64 128 256" [VARIANTS="-|--merge pivot"] scripts/sweep.sh BENCHMARK SAVE_DIR [runner args...]
# BENCHMARK: longbench | ruler | needle. Runner args go to every run, e.g.
#   scripts/sweep.sh ruler results/ruler --model_path smollm2-135m --context_lengths 2048 --num_samples 5
# A rerun resumes: finished samples are skipped by the runners. PUBLIC_HARNESS_SETTINGS=1 runs each
# method with the public harness's settings (window 8, kernel 7, max pooling; see sweep_tasks.sh).
# Paths (SAVE_DIR, --data_dir, --model_path, ...) are read from the folder it is called from.
set -euo pipefail
if [ $# -lt 2 ]; then sed -n 2,8p "$0"; exit 2; fi
benchmark=$1; save_dir=$2; shift 2
SWEEP_ROOT=$(cd "$(dirname "$0")/.." && pwd)   # the runners run from here by their full path; no cd
PYTHON=${PYTHON:-$( [ -x "$SWEEP_ROOT/.venv/bin/python" ] && echo "$SWEEP_ROOT/.venv/bin/python" || echo python )}
source "$SWEEP_ROOT/scripts/sweep_tasks.sh"
check_sweep_tasks "$benchmark" --save_dir "$save_dir" "$@"
record_sweep_runs "$benchmark" "$save_dir"
for task in "${SWEEP_TASKS[@]}"; do
  run_sweep_task "$benchmark" "$task" --save_dir "$save_dir" "$@"
done
"$PYTHON" "$SWEEP_ROOT/scripts/summarize_results.py" "$save_dir"
