# Sourced by scripts/sweep.sh and scripts/slurm/sweep.sbatch: the (method, budget) grid of a sweep.
# Inputs (environment): METHODS="snapkv pyramidkv h2o streamingllm l2norm", BUDGETS="64 128 256",
#   FULLKV=1 to add one fullkv run (it takes no budget),
#   PUBLIC_HARNESS_SETTINGS=1 to run every method with the public harness's settings (window 8,
#   kernel 7, max pooling where the method has them; default 0: this package's defaults).
# Output: the array SWEEP_TASKS of "method budget" pairs ("fullkv -" for the full cache).
METHODS=${METHODS:-"snapkv pyramidkv h2o streamingllm l2norm"}
BUDGETS=${BUDGETS:-"64 128 256"}
FULLKV=${FULLKV:-1}
SWEEP_TASKS=()
if [ "$FULLKV" = "1" ]; then SWEEP_TASKS+=("fullkv -"); fi
for method in $METHODS; do
  if [ "$method" = "fullkv" ]; then continue; fi
  for budget in $BUDGETS; do SWEEP_TASKS+=("$method $budget"); done
done

source "$(dirname "${BASH_SOURCE[0]}")/public_harness_settings.sh"

# run_sweep_task BENCHMARK "method budget" [extra runner args...]: one run, results in the usual layout.
run_sweep_task() {
  local benchmark=$1 task=$2; shift 2
  local method=${task% *} budget=${task#* }
  local runner
  case "$benchmark" in
    longbench) runner=run_longbench.py ;;
    ruler) runner=run_ruler.py ;;
    needle) runner=run_needle_in_haystack.py ;;
    *) echo "unknown benchmark '$benchmark'; use longbench, ruler or needle" >&2; return 2 ;;
  esac
  local budget_args=()
  if [ "$budget" != "-" ]; then budget_args=(--max_capacity_prompts "$budget"); fi
  local method_args=()
  if [ "${PUBLIC_HARNESS_SETTINGS:-0}" = "1" ]; then mapfile -t method_args < <(public_harness_method_args "$method"); fi
  echo ">>> $benchmark: method=$method budget=$budget ${method_args[*]}" >&2
  "${PYTHON:-python}" "$runner" --method "$method" "${budget_args[@]}" "${method_args[@]}" "$@"
}
