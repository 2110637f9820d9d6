"""Command-line conventions shared by run_longbench.py, run_ruler.py and run_needle_in_haystack.py.

Flag names follow the public PyramidKV harness (`--method`, `--model_path`,
`--max_capacity_prompts`, `--attn_implementation`, `--save_dir`, ...). Method
settings given on the command line are passed to the method; one the method
does not have is an error (never parsed and ignored). Defaults live only in
the method dataclasses.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pyramidkv.allocation import HEAD_ALLOCATIONS, LAYER_ALLOCATIONS
from pyramidkv.merging import MERGE_RULES
from pyramidkv.methods import METHODS, Method, make_method
from pyramidkv.models.default_model import DEFAULT_MODEL_NAME
from pyramidkv.quantization import QUANTIZERS

# CLI flag -> method setting. A flag left unset is not passed (the method's default applies).
METHOD_FLAGS = {
    "max_capacity_prompts": "budget",
    "max_capacity_prompts_ratio": "budget_ratio",
    "window_sizes": "window_size",
    "kernel_sizes": "kernel_size",
    "pooling": "pooling",
    "beta": "beta",
    "num_sinks": "num_sinks",
    "gqa_layout": "gqa_layout",
    "gqa_reduce": "gqa_reduce",
    "gqa_pooling": "gqa_pooling",
    "skip_layers": "skip_layers",
    "head_allocation": "head_allocation",
    "layer_allocation": "layer_allocation",
    "floor": "floor_ratio",
    "normalize": "normalize",
    "head_path": "head_scores",
    "head_beta": "head_beta",
    "attention_threshold": "attention_threshold",
    "b_bound_ratio": "b_bound_ratio",
    "merge": "merge",
    "similarity_threshold": "similarity_threshold",
    "merge_fraction": "merge_fraction",
    "merge_budget": "merge_budget",
    "start_budget_ratio": "start_budget_ratio",
    "merge_sampling": "sampling",
    "merge_seed": "seed",
    "quant_method": "quant_method",
    "nbits": "nbits",
    "q_group_size": "group_size",
    "quant_residual_length": "residual_length",
    "quant_outlier_fraction": "outlier_fraction",
    "quant_sink_tokens": "sink_tokens",
    "quant_datatype": "datatype",
    "quant_rank": "rank",
    "quant_decode_rank": "decode_rank",
    "decode_budget": "decode_budget",
    "decode_interval": "decode_interval",
    "random_fraction": "random_fraction",
    "random_seed": "random_seed",
    "proxy_size": "proxy_size",
    "key_channel_ratio": "key_channel_ratio",
    "key_recent_size": "key_recent_size",
    "key_query_window": "key_query_window",
    "history_window": "history_window",
}


def add_model_and_method_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model_path", default=DEFAULT_MODEL_NAME,
                   help=f"local HF directory, hub id, or {DEFAULT_MODEL_NAME!r} (embedded default)")
    g.add_argument("--model_class", choices=["llama", "mistral"], default=None,
                   help="load the weights into this architecture instead of the config's")
    g.add_argument("--attn_implementation", default="sdpa", choices=["eager", "sdpa", "flash_attention_2"])
    g.add_argument("--device", default="auto", help="cpu, cuda[:N] or auto")
    g.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"],
                   help="default: float32 on CPU, bfloat16 on CUDA")
    m = parser.add_argument_group("compression method")
    m.add_argument("--method", required=True, type=str.lower, choices=list(METHODS))
    m.add_argument("--max_capacity_prompts", type=int, default=None,
                   help="tokens kept per layer per head, observation window included")
    m.add_argument("--max_capacity_prompts_ratio", type=float, default=None,
                   help="budget as a fraction of each prompt's length (instead of --max_capacity_prompts)")
    m.add_argument("--window_sizes", type=int, default=None, help="observation window (method default if unset)")
    m.add_argument("--kernel_sizes", type=int, default=None, help="SnapKV/PyramidKV pooling kernel")
    m.add_argument("--pooling", choices=["max", "avg"], default=None)
    m.add_argument("--beta", type=float, default=None,
                   help="pyramid layer allocation: min layer budget = (budget - window) / beta (default 20)")
    m.add_argument("--num_sinks", type=int, default=None, help="StreamingLLM sink tokens")
    m.add_argument("--gqa_layout", choices=["kv_head", "query_head"], default=None)
    m.add_argument("--gqa_reduce", choices=["mean", "max", "sum"], default=None)
    m.add_argument("--gqa_pooling", choices=["after_reduce", "before_reduce"], default=None,
                   help="SnapKV/PyramidKV in the kv_head layout: pool the scores after reducing the query group "
                        "(the public code's order, default) or pool each query head first")
    m.add_argument("--skip_layers", type=int, default=None,
                   help="L2Norm: the first N layers keep the whole prompt (paper default 2)")
    a = parser.add_argument_group("budget allocation (any method; defaults: the method's own)")
    a.add_argument("--head_allocation", choices=list(HEAD_ALLOCATIONS), default=None,
                   help="split each layer's budget across heads: uniform, adakv (AdaKV), headkv (HeadKV table)")
    a.add_argument("--layer_allocation", choices=list(LAYER_ALLOCATIONS), default=None,
                   help="split the budget across layers: uniform, pyramid (PyramidKV), zigzag (ZigZagKV)")
    a.add_argument("--floor", type=float, default=None,
                   help="adakv: floor_ratio, the share of the uniform budget every head keeps at least (default 0.2)")
    a.add_argument("--normalize", action="store_true", default=None,
                   help="adakv: scale each head's scores by its top-budget mass before the global top-k")
    a.add_argument("--head_path", default=None,
                   help="headkv: head-score table (HeadKV JSON; default: the table shipped for the model, "
                        "else make one with scripts/head_scores.py)")
    a.add_argument("--head_beta", type=float, default=None,
                   help="headkv: each head keeps at least s - s // head_beta selected tokens (default 1.01)")
    a.add_argument("--attention_threshold", type=float, default=None,
                   help="zigzag: score mass LMBA counts (default 0.9)")
    a.add_argument("--b_bound_ratio", type=float, default=None,
                   help="zigzag: each layer's guaranteed share of the uniform budget (default 0.2)")
    mg = parser.add_argument_group("merging evicted tokens (any method but fullkv; default: drop them)")
    mg.add_argument("--merge", type=str.lower, choices=list(MERGE_RULES), default=None,
                    help="fold evicted tokens into kept ones: pivot | weighted (the public harness's rules), "
                         "mergingpress (merge-on-evict, values only), cam (CaM)")
    mg.add_argument("--similarity_threshold", type=float, default=None,
                    help="mergingpress: merge only evicted tokens at least this cosine-similar to their target "
                         "(default 0.0)")
    mg.add_argument("--merge_fraction", type=float, default=None,
                    help="mergingpress: merge only this fraction of the eligible tokens, most similar first (default 1.0)")
    mg.add_argument("--merge_budget", type=int, default=None,
                    help="cam: kept tokens each evicted value is spread over (default: the window size)")
    mg.add_argument("--start_budget_ratio", type=float, default=None,
                    help="cam: share of the prompt's first tokens used as CaM's reference and never merged (default 0.1)")
    mg.add_argument("--merge_sampling", action="store_true", default=None,
                    help="cam: draw each merge (Bernoulli) instead of merging its expectation (seeded by --merge_seed)")
    mg.add_argument("--merge_seed", type=int, default=None, help="cam with --merge_sampling: the seed (default 0)")
    q = parser.add_argument_group("quantized KV storage (any method; default: the model dtype)")
    q.add_argument("--quant_method", type=str.lower, choices=list(QUANTIZERS), default=None,
                   help="store the kept and generated tokens quantized: kivi (KIVI), kvquant (KVQuant), gear (GEAR)")
    q.add_argument("--nbits", type=int, default=None, help="bits per code: 2, 4 or 8 (kivi/gear 2, kvquant 4)")
    q.add_argument("--q_group_size", type=int, default=None,
                   help="values per quantization group; must divide the head dim (kivi 32, kvquant 32, gear 64)")
    q.add_argument("--quant_residual_length", type=int, default=None,
                   help="recent tokens kept in full precision, a multiple of the group size (kivi 128, kvquant 0, "
                        "gear 64)")
    q.add_argument("--quant_outlier_fraction", type=float, default=None,
                   help="kvquant / gear: share of entries kept exactly as sparse outliers (0.01 / 0.02)")
    q.add_argument("--quant_sink_tokens", type=int, default=None,
                   help="kvquant: first prompt tokens kept in full precision (default 1)")
    q.add_argument("--quant_datatype", choices=["uniform", "nuq"], default=None,
                   help="kvquant: uniform levels, or nuq (1-D k-means levels fitted per block, not calibrated)")
    q.add_argument("--quant_rank", type=int, default=None, help="gear: low-rank rank at prefill (default 4)")
    q.add_argument("--quant_decode_rank", type=int, default=None,
                   help="gear: low-rank rank of blocks compressed while decoding (default 2)")
    d = parser.add_argument_group("compression during decoding (any method but fullkv; default: off)")
    d.add_argument("--decode_budget", type=int, default=None,
                   help="tokens per head the cache may hold while generating (>= the window); every "
                        "--decode_interval new tokens each layer re-selects down to it with the method's scorer")
    d.add_argument("--decode_interval", type=int, default=None,
                   help="new tokens between two decode-time compressions; the cache holds at most "
                        "decode_budget + decode_interval tokens per head (default 32)")
    e = parser.add_argument_group("selection extras (any method but fullkv): NACL's random share, ThinK's key "
                                  "channels, Scissorhands' history (docs/methods.md)")
    e.add_argument("--random_fraction", type=float, default=None,
                   help="share of the selected tokens drawn from softmax(score) instead of by score (nacl)")
    e.add_argument("--random_seed", type=int, default=None, help="seed of the random share")
    e.add_argument("--proxy_size", type=int, default=None, help="nacl: prompt queries that score the tokens")
    e.add_argument("--key_channel_ratio", type=float, default=None,
                   help="ThinK: share of key channels pruned (think: 0.4; other methods: 0, off)")
    e.add_argument("--key_recent_size", type=int, default=None, help="ThinK: most recent kept keys left full width")
    e.add_argument("--key_query_window", type=int, default=None, help="ThinK: prompt queries scoring the channels")
    e.add_argument("--history_window", type=int, default=None,
                   help="scissorhands: decode steps whose attention is counted")
    r = parser.add_argument_group("run")
    r.add_argument("--num_threads", type=int, default=None,
                   help="CPU threads for torch (default: torch's choice; 1 is faster on a busy shared CPU)")
    r.add_argument("--overwrite", action="store_true",
                   help="delete the run folder's earlier results first (needed to rerun a folder with other "
                        "settings: a resume must match the stored configuration)")


# Errors a runner reports as one line and exit status 2 (bad input, found before anything is written).
INPUT_ERRORS = (ValueError, TypeError, ImportError, OSError, RuntimeError)


def fail(parser: argparse.ArgumentParser, error: BaseException) -> None:
    """Print `error` as one line and exit 2."""
    message = " ".join(str(error).split("\n")).strip() or type(error).__name__
    parser.exit(2, f"{parser.prog}: error: {message}\n")


def check_run_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.num_threads is not None and args.num_threads < 1:
        parser.error(f"--num_threads must be >= 1, got {args.num_threads}")


def apply_num_threads(args: argparse.Namespace) -> None:
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)


def method_from_args(args: argparse.Namespace) -> Method:
    settings = {setting: getattr(args, flag) for flag, setting in METHOD_FLAGS.items()
                if getattr(args, flag, None) is not None}
    return make_method(args.method, **settings)


def budget_label(method: Method) -> str:
    """The budget part of the output folder name: 128, r0.25, or full."""
    if method.budget is not None:
        return str(method.budget)
    if method.budget_ratio is not None:
        return f"r{method.budget_ratio:g}"
    return "full"


def budget_value(method: Method):
    """The budget as results.json records it: an int, "r<ratio>", or None for the full cache."""
    if method.budget is not None:
        return method.budget
    if method.budget_ratio is not None:
        return f"r{method.budget_ratio:g}"
    return None


def model_label(model_path: str) -> str:
    return Path(model_path.rstrip("/")).name


def run_dir(save_dir: str, model_path: str, method: Method) -> Path:
    """{save_dir}/{model}_{budget}/{method.label()}: the public harness's layout for a method at its
    defaults; settings other than the defaults are appended to the method folder (Component.label:
    snapkv_window_size=8_pooling=avg, adakv_floor_ratio=0.5, snapkv_head_allocation=adakv-floor_ratio=0.3)."""
    return Path(save_dir) / f"{model_label(model_path)}_{budget_label(method)}" / method.label()


def check_model_args(args: argparse.Namespace, method: Method | None = None):
    """load_model's checks without loading weights: (resolved path, config, device, dtype). With the method:
    also what the method needs from the model (a quantizer's group size must divide the head dim)."""
    from pyramidkv.models.loading import check_model

    checked = check_model(args.model_path, args.attn_implementation, args.device, args.dtype, args.model_class)
    config = checked[1]
    if method is not None and method.quant_method is not None and config is not None:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        method.quant_method.check_head_dim(head_dim)
    return checked


def run_fingerprint(args: argparse.Namespace, method: Method, model_check, extra: dict | None = None) -> dict:
    """The generation fingerprint of this invocation (see pyramidkv/runner/run_folder.py)."""
    from pyramidkv.runner.run_folder import file_digest, generation_fingerprint, model_fingerprint

    path, _, device, dtype = model_check
    table = getattr(method.head_allocation, "head_scores", None)
    if table is not None and Path(table).is_file():  # a table edited in place under the same path shows
        extra = {**(extra or {}), "head_scores_file": file_digest(Path(table))}
    return generation_fingerprint(vars(args), method, model_fingerprint(path),
                                  {"device": device.split(":")[0], "dtype": dtype}, extra)
