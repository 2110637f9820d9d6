#!/usr/bin/env bash
# Needle in a haystack under one compression method, then its heatmap. Positional arguments in the
# public harness's order:
#   bash scripts/scripts_needle/eval.sh GPU METHOD MAX_CAPACITY_PROMPTS ATTN_IMPLEMENTATION MODEL_PATH \
#        [S_LEN [E_LEN [STEP]]] [extra run_needle_in_haystack.py args...]
# e.g.
#   bash scripts/scripts_needle/eval.sh 0 snapkv 128 sdpa smollm2-135m 1000 4000 1000 --num_depths 5
#   bash scripts/scripts_needle/eval.sh 0 cam 128 sdpa smollm2-135m "" "" "" --merge_sampling --merge_seed 1
#   bash scripts/scripts_needle/eval.sh 0 streamingllm 128 sdpa smollm2-135m "" "" "" --decode_budget 256 --decode_interval 64
# S_LEN/E_LEN/STEP default to 1000/4000/1000 (give "" to keep a default and still pass extra args).
# Extra args go to run_needle_in_haystack.py (--num_depths, --save_dir, --model_version, ...).
# On a machine without a GPU give any value as GPU: the device is chosen with --device auto.
# A method that takes no budget (fullkv; kvzap, duo_attention: a threshold) gets no MAX_CAPACITY_PROMPTS (a note says so).
# Results: results/needle/{model}_{budget}/{method}/ (needle.jsonl, results.json, needle_rouge1_f.png).
# Method settings: those of the public harness (window 8, kernel 7, max pooling where the method
# has them; scripts/public_harness_settings.sh); extra args come after them and override.
# Set PYTHON to choose the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail

if [ "$#" -lt 5 ]; then
    echo "usage: $0 GPU METHOD MAX_CAPACITY_PROMPTS ATTN_IMPLEMENTATION MODEL_PATH [S_LEN [E_LEN [STEP]]] [extra args...]" >&2
    exit 2
fi

export CUDA_VISIBLE_DEVICES=$1
method=$2
max_capacity_prompts=$3
attn_implementation=$4
model_path=$5
s_len=${6:-}
e_len=${7:-}
step=${8:-}
s_len=${s_len:-1000}
e_len=${e_len:-4000}
step=${step:-1000}
if [ "$#" -ge 8 ]; then shift 8; else shift "$#"; fi

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if [ -z "${PYTHON:-}" ]; then
    if [ -x "${repo_root}/.venv/bin/python" ]; then PYTHON="${repo_root}/.venv/bin/python"; else PYTHON=python3; fi
fi

source "${repo_root}/scripts/public_harness_settings.sh"
mapfile -t method_args < <(public_harness_method_args "${method}")

budget_args=(--max_capacity_prompts "${max_capacity_prompts}")
if ! PYTHON="${PYTHON}" method_takes_budget "${method}"; then
    echo "note: ${method} takes no budget (it keeps every token, or a threshold decides each head's count); max_capacity_prompts=${max_capacity_prompts} is not used" >&2
    budget_args=()
fi

args=(
    --method "${method}"
    --model_path "${model_path}"
    "${budget_args[@]}"
    "${method_args[@]}"
    --attn_implementation "${attn_implementation}"
    --device auto
    --s_len "${s_len}" --e_len "${e_len}" --step "${step}"
    "$@"
)

out_dir="$("${PYTHON}" "${repo_root}/run_needle_in_haystack.py" "${args[@]}" --print_run_dir)"
"${PYTHON}" "${repo_root}/run_needle_in_haystack.py" "${args[@]}"
"${PYTHON}" "${repo_root}/scripts/scripts_needle/visualize.py" "${out_dir}" --annotate
