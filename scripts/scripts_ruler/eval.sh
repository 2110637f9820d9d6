#!/usr/bin/env bash
# RULER under one compression method, with the public harness's positional arguments:
#   bash scripts/scripts_ruler/eval.sh GPU METHOD MAX_CAPACITY_PROMPTS ATTN_IMPLEMENTATION SOURCE_PATH MODEL_PATH [extra run_ruler.py args...]
# e.g.
#   bash scripts/scripts_ruler/eval.sh 0 snapkv 128 sdpa ./ smollm2-135m --context_lengths 2048 --num_samples 5
#   bash scripts/scripts_ruler/eval.sh 0 snapkv 128 sdpa ./ smollm2-135m --merge mergingpress   # merged (own folder)
#   bash scripts/scripts_ruler/eval.sh 0 snapkv 128 sdpa ./ smollm2-135m --decode_budget 256   # compressed while decoding (own folder)
# Results: SOURCE_PATH/results_ruler/{model}_{budget}/{method}/ (git-ignored with SOURCE_PATH ./).
# Runs on CPU too (--device auto).
# Method settings: those of the public harness (window 8, kernel 7, max pooling where the method
# has them; scripts/public_harness_settings.sh); extra args come after them and override.
# A method that takes no budget (fullkv; kvzap, duo_attention: a threshold) gets no MAX_CAPACITY_PROMPTS (a note says so).
# Set PYTHON to choose the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail

if [ "$#" -lt 6 ]; then
    echo "usage: $0 GPU METHOD MAX_CAPACITY_PROMPTS ATTN_IMPLEMENTATION SOURCE_PATH MODEL_PATH [extra args...]" >&2
    exit 2
fi

export CUDA_VISIBLE_DEVICES=$1
method=$2
max_capacity_prompts=$3
attn_implementation=$4
source_path=$5
model_path=$6
shift 6

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "${repo_root}/.venv/bin/python" ]; then PYTHON="${repo_root}/.venv/bin/python"; else PYTHON=python3; fi
fi
source "${repo_root}/scripts/public_harness_settings.sh"
save_dir="$(results_dir "${source_path}" results_ruler)"
mapfile -t method_args < <(public_harness_method_args "${method}")

budget_args=(--max_capacity_prompts "${max_capacity_prompts}")
if ! PYTHON="${PYTHON}" method_takes_budget "${method}"; then
    echo "note: ${method} takes no budget (it keeps every token, or a threshold decides each head's count); max_capacity_prompts=${max_capacity_prompts} is not used" >&2
    budget_args=()
fi

exec "${PYTHON}" "${repo_root}/run_ruler.py" \
    --method "${method}" \
    --model_path "${model_path}" \
    "${budget_args[@]}" \
    "${method_args[@]}" \
    --attn_implementation "${attn_implementation}" \
    --device auto \
    --save_dir "${save_dir}" \
    "$@"
