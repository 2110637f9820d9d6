# Sourced by the eval.sh scripts and scripts/sweep_tasks.sh.
#
# public_harness_method_args METHOD: prints, one per line, the method flags with which a run of
# ours reproduces the public PyramidKV harness (Zefan-Cai/KVCache-Factory): its runners fix
# window 8, kernel 7 and max pooling, while our defaults are window 32 (kernel 7, max pooling).
# Only the settings a method has are printed (make_method rejects unknown ones):
#   snapkv, pyramidkv, and the adaptive methods it also runs (adakv, ada_pyramidkv, headkv):
#                      --window_sizes 8 --kernel_sizes 7 --pooling max
#   h2o, cam:          --window_sizes 8 (CAM there has no pooling: our cam's kernel_size 1 already)
#   streamingllm:      nothing (our 4 sinks + budget-4 recent tokens = the harness's window budget-4)
#   l2norm, fullkv:    nothing (no observation window there; l2norm's defaults follow the harness)
public_harness_method_args() {
    case "$(echo "$1" | tr '[:upper:]' '[:lower:]')" in
        snapkv|pyramidkv|adakv|ada_pyramidkv|headkv) printf '%s\n' --window_sizes 8 --kernel_sizes 7 --pooling max ;;
        h2o|cam) printf '%s\n' --window_sizes 8 ;;
        *) ;;
    esac
}

# results_dir SOURCE_PATH NAME: SOURCE_PATH/NAME with exactly one slash between them
# ("./" -> ./NAME, "/data/x" -> /data/x/NAME, "" -> NAME).
results_dir() {
    local source_path=$1 name=$2
    if [ -z "$source_path" ]; then
        printf '%s\n' "$name"
    else
        while [ "${source_path%/}" != "$source_path" ] && [ "$source_path" != "/" ]; do
            source_path=${source_path%/}
        done
        if [ "$source_path" = "/" ]; then printf '/%s\n' "$name"; else printf '%s/%s\n' "$source_path" "$name"; fi
    fi
}

# method_takes_budget METHOD: exit status 0 when the method at its defaults takes a budget (the registry's
# takes_budget); 1 for one that keeps every token (fullkv, minicache, minference) or decides each head's count by
# a threshold (kvzap, duo_attention): the eval.sh scripts then do not pass MAX_CAPACITY_PROMPTS on.
method_takes_budget() {
    local repo
    repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" "${PYTHON:-python3}" -c "import sys; from pyramidkv.methods import \
METHODS, budget_flag_applies; c = METHODS.get(sys.argv[1].lower()); sys.exit(0 if c is None or budget_flag_applies(c) else 1)" "$1"
}
