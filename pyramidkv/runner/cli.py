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

from pyramidkv.methods import METHODS, Method, make_method
from pyramidkv.models.default_model import DEFAULT_MODEL_NAME

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
    m.add_argument("--beta", type=float, default=None, help="PyramidKV: min layer budget = (budget - window) / beta")
    m.add_argument("--num_sinks", type=int, default=None, help="StreamingLLM sink tokens")
    m.add_argument("--gqa_layout", choices=["kv_head", "query_head"], default=None)
    m.add_argument("--gqa_reduce", choices=["mean", "max", "sum"], default=None)
    m.add_argument("--gqa_pooling", choices=["after_reduce", "before_reduce"], default=None,
                   help="SnapKV/PyramidKV in the kv_head layout: pool the scores after reducing the query group "
                        "(the public code's order, default) or pool each query head first")
    m.add_argument("--skip_layers", type=int, default=None,
                   help="L2Norm: the first N layers keep the whole prompt (paper default 2)")


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
    """{save_dir}/{model}_{budget}/{method}: the layout users know from the public harness."""
    return Path(save_dir) / f"{model_label(model_path)}_{budget_label(method)}" / method.name
