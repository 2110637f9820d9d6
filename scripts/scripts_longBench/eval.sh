#!/usr/bin/env bash
# LongBench with one compression method, then scoring. Same positional arguments as the public
# PyramidKV harness:
#   bash scripts/scripts_longBench/eval.sh GPU METHOD MAX_CAPACITY_PROMPTS ATTN_IMPLEMENTATION SOURCE_PATH MODEL_PATH [extra run_longbench.py args...]
# e.g. bash scripts/scripts_longBench/eval.sh 0 SnapKV 128 sdpa ./ smollm2-135m --data_dir path/to/LongBench/data
#      bash scripts/scripts_longBench/eval.sh 0 PyramidKV 128 sdpa ./ smollm2-135m --merge pivot   # merged run, own folder
#      bash scripts/scripts_longBench/eval.sh 0 H2O 128 sdpa ./ smollm2-135m --decode_budget 256   # compressed while decoding too, own folder
# On a machine without a GPU give any value (e.g. "") as GPU: the device is chosen with --device auto.
# Results: SOURCE_PATH/results_long_bench/{model}_{budget}/{method}/ (results.json after scoring);
# with SOURCE_PATH ./ that folder is git-ignored.
# Method settings: those of the public harness's published runs (window 8, kernel 7, max pooling
# where the method has them; see scripts/public_harness_settings.sh and docs/longbench.md).
# Extra args come after them, so e.g. --window_sizes 32 overrides.
set -euo pipefail

if [ "$#" -lt 6 ]; then
    echo "usage: $0 GPU METHOD MAX_CAPACITY_PROMPTS ATTN_IMPLEMENTATION SOURCE_PATH MODEL_PATH [run_longbench.py args...]" >&2
    exit 2
fi

export CUDA_VISIBLE_DEVICES=$1
method=$2                 # FullKV, StreamingLLM, H2O, SnapKV, PyramidKV, L2Norm, ... (case-insensitive)
max_capacity_prompts=$3   # tokens kept per layer per head (128, 2048 in the paper); ignored for FullKV
attn_implementation=$4    # sdpa, eager or flash_attention_2
source_path=$5
model_path=$6
shift 6

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
source "$repo_root/scripts/public_harness_settings.sh"
save_dir="$(results_dir "$source_path" results_long_bench)"
mapfile -t method_args < <(public_harness_method_args "$method")
python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
    if [ -x "$repo_root/.venv/bin/python" ]; then python_bin="$repo_root/.venv/bin/python"; else python_bin=python3; fi
fi

budget_args=(--max_capacity_prompts "$max_capacity_prompts")
if ! PYTHON="$python_bin" method_takes_budget "${method}"; then
    echo "note: ${method} takes no budget (it keeps every token, or a threshold decides each head's count); max_capacity_prompts=${max_capacity_prompts} is not used" >&2
    budget_args=()
fi

"$python_bin" "$repo_root/run_longbench.py" \
    --method "$method" \
    --model_path "$model_path" \
    "${budget_args[@]}" \
    "${method_args[@]}" \
    --attn_implementation "$attn_implementation" \
    --device auto \
    --save_dir "$save_dir" \
    "$@"

"$python_bin" "$repo_root/eval.py" --results_dir "$save_dir"
