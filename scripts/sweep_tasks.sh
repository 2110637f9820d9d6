# Sourced by scripts/sweep.sh and scripts/slurm/sweep.sbatch: the (method, budget, variant) grid of a sweep.
# Inputs (environment): METHODS="snapkv pyramidkv h2o streamingllm l2norm", BUDGETS="64 128 256",
#   VARIANTS: runner flags each method x budget is also run with, separated by "|"; "-" is the method as
#     it is. E.g. VARIANTS="-|--merge mergingpress|--merge pivot" runs every method without merging,
#     with merge-on-evict and with pivot merging (each in its own folder, see the README).
#   FULLKV=1 to add one fullkv run (it takes no budget and no merging variant),
#   FULLKV_VARIANTS: runner flags fullkv is run with, "|"-separated like VARIANTS (default "-": once, as it
#     is); e.g. FULLKV_VARIANTS="-|--quant_method kivi --nbits 2" adds the quantized full cache,
#   PUBLIC_HARNESS_SETTINGS=1 to run every method with the public harness's settings (window 8,
#   kernel 7, max pooling where the method has them; default 0: this package's defaults).
#   SWEEP_ROOT: the repository, when the runners are called from another folder (scripts/sweep.sh sets it).
# Output: the array SWEEP_TASKS of "method budget|variant" entries ("fullkv -|-" for the full cache; a method
# that takes no budget, e.g. minicache, gets "-" as its budget and runs once per variant).
METHODS=${METHODS:-"snapkv pyramidkv h2o streamingllm l2norm"}
BUDGETS=${BUDGETS:-"64 128 256"}
VARIANTS=${VARIANTS:-"-"}
FULLKV=${FULLKV:-1}
SWEEP_TASKS=()
FULLKV_VARIANTS=${FULLKV_VARIANTS:-"-"}
if [ "$FULLKV" = "1" ]; then
  IFS='|' read -r -a _fullkv_variants <<< "$FULLKV_VARIANTS"
  for variant in "${_fullkv_variants[@]}"; do SWEEP_TASKS+=("fullkv -|$variant"); done
fi
IFS='|' read -r -a _sweep_variants <<< "$VARIANTS"
# Methods that take no budget (fullkv, minicache, minference, and threshold eviction's kvzap, duo_attention: read
# from the registry) run once per variant (a threshold sweep: VARIANTS="--threshold -4|--threshold -6").
_sweep_repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_no_budget=$(PYTHONPATH="$_sweep_repo${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python}" -c 'from pyramidkv.methods import METHODS, budget_flag_applies
print(" ".join(n for n, c in METHODS.items() if not budget_flag_applies(c)))')
for method in $METHODS; do
  if [ "$method" = "fullkv" ]; then continue; fi
  if [[ " $_no_budget " == *" $method "* ]]; then
    for variant in "${_sweep_variants[@]}"; do SWEEP_TASKS+=("$method -|$variant"); done
    continue
  fi
  for budget in $BUDGETS; do
    for variant in "${_sweep_variants[@]}"; do SWEEP_TASKS+=("$method $budget|$variant"); done
  done
done

source "$(dirname "${BASH_SOURCE[0]}")/public_harness_settings.sh"

# check_sweep_tasks BENCHMARK [extra runner args...]: every run of the grid has valid arguments (checked as each
# runner's --print_run_dir checks them, loading nothing, all in one process: scripts/run_dirs.py), so one bad
# variant stops the sweep before its first run, with a summary of every bad one. Sets SWEEP_RUN_DIRS: the runs'
# folders, in task order.
check_sweep_tasks() {
  local benchmark=$1; shift
  local task bad=0 i=0 status value
  local -a lines
  SWEEP_RUN_DIRS=()
  sweep_runner "$benchmark" >/dev/null || return 2
  mapfile -t lines < <(
    for task in "${SWEEP_TASKS[@]}"; do
      sweep_task_argv "$benchmark" "$task" "$@" --print_run_dir
      printf '%s\0' "$(( ${#SWEEP_ARGV[@]} - 1 ))" "${SWEEP_ARGV[@]:1}"
    done | PYTHONPATH="$_sweep_repo${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python}" "$_sweep_repo/scripts/run_dirs.py" \
      "$benchmark")
  if [ "${#lines[@]}" -ne "${#SWEEP_TASKS[@]}" ]; then
    echo "error: checking the sweep's ${#SWEEP_TASKS[@]} runs gave ${#lines[@]} answers (scripts/run_dirs.py failed)" >&2
    return 2
  fi
  for task in "${SWEEP_TASKS[@]}"; do
    IFS=$'\t' read -r status value <<< "${lines[$i]}"
    i=$((i + 1))
    if [ "$status" = ok ]; then
      SWEEP_RUN_DIRS+=("$value")
    else
      bad=$((bad + 1))
      echo "invalid run '$task': $value" >&2
    fi
  done
  if [ "$bad" -gt 0 ]; then
    echo "error: $bad of ${#SWEEP_TASKS[@]} runs of the sweep have invalid arguments; nothing was run" >&2
    return 2
  fi
}

# record_sweep_runs BENCHMARK SAVE_DIR: adds the folders check_sweep_tasks found to SAVE_DIR/sweep_runs.txt,
# one "<benchmark> <folder relative to SAVE_DIR>" line each, once. summarize_results.py lists every run there
# that has no results.json (it failed, was killed or never started) instead of leaving it out.
record_sweep_runs() {
  local benchmark=$1 save_dir=$2 dir line
  mkdir -p "$save_dir"
  for dir in "${SWEEP_RUN_DIRS[@]}"; do
    line="$benchmark $(realpath -m --relative-to="$save_dir" "$dir")"
    grep -qxF -- "$line" "$save_dir/sweep_runs.txt" 2>/dev/null || echo "$line" >> "$save_dir/sweep_runs.txt"
  done
}

# sweep_runner BENCHMARK: the runner script of a benchmark (printed), or an error.
sweep_runner() {
  case "$1" in
    longbench) echo run_longbench.py ;;
    ruler) echo run_ruler.py ;;
    needle) echo run_needle_in_haystack.py ;;
    *) echo "unknown benchmark '$1'; use longbench, ruler or needle" >&2; return 2 ;;
  esac
}

# sweep_task_argv BENCHMARK "method budget|variant" [extra runner args...]: sets SWEEP_ARGV to the run's command
# (the runner's path, then its arguments).
sweep_task_argv() {
  local benchmark=$1 task=$2; shift 2
  local head=${task%%|*} variant=${task#*|}
  local method=${head% *} budget=${head#* }
  local runner
  runner=$(sweep_runner "$benchmark") || return 2
  local budget_args=()
  if [ "$budget" != "-" ]; then budget_args=(--max_capacity_prompts "$budget"); fi
  local method_args=()
  if [ "${PUBLIC_HARNESS_SETTINGS:-0}" = "1" ]; then mapfile -t method_args < <(public_harness_method_args "$method"); fi
  local variant_args=()
  if [ "$variant" != "-" ] && [ "$variant" != "$task" ]; then read -r -a variant_args <<< "$variant"; fi
  SWEEP_ARGV=("${SWEEP_ROOT:+$SWEEP_ROOT/}$runner" --method "$method" "${budget_args[@]}" "${method_args[@]}" \
    "${variant_args[@]}" "$@")
}

# run_sweep_task BENCHMARK "method budget|variant" [extra runner args...]: one run, results in the usual layout.
run_sweep_task() {
  sweep_task_argv "$@" || return 2
  if [ -z "${SWEEP_QUIET:-}" ]; then echo ">>> $1 '$2': ${SWEEP_ARGV[*]:1}" >&2; fi
  "${PYTHON:-python}" "${SWEEP_ARGV[@]}"
}
