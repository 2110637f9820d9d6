#!/usr/bin/env python
"""The README's "See what it keeps" figures: what four methods keep of a pass-key prompt, where
layer 12's heads attend around the needle, and how the budget is split over layers. ~40 s on a CPU.

    python examples/see_what_it_keeps.py --figures_dir docs/figures
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from pyramidkv import load_model, make_method
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.viz import (
    allocation_variants, plot_attention_map, plot_budget_maps, plot_kept_tokens, plot_score_curve, tokenize,
)

from pyramidkv.benchmarks.prompting import passkey_prompt

PASS_KEY = 73691


def main(argv=None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--figures_dir", default="results/figures", help="where the PNGs go")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--layer", type=int, default=12)
    args = parser.parse_args(argv)
    try:
        make_method("snapkv", budget=args.budget)
    except ValueError as e:
        parser.error(f"--budget {args.budget}: {e}")
    model, tokenizer = load_model("smollm2-135m", attn_implementation="eager", device="cpu")
    prompt = passkey_prompt(tokenizer, PASS_KEY, num_fillers=12)
    needle = tokenize(tokenizer, prompt).span_of(str(PASS_KEY))
    methods = {name: make_method(name, budget=args.budget) for name in ("snapkv", "pyramidkv", "h2o", "streamingllm")}
    budget_methods = {"snapkv": methods["snapkv"], "pyramidkv": methods["pyramidkv"],
                      **allocation_variants("snapkv", budget=args.budget)}
    figures = {
        "kept_tokens": plot_kept_tokens(model, tokenizer, prompt, methods, highlight=str(PASS_KEY)),
        "attention_map": plot_attention_map(model, tokenizer, prompt, args.layer, heads=[0, 1, 2],
                                            label_span=(needle[0] - 8, needle[-1] + 9), highlight=str(PASS_KEY)),
        "score_curve": plot_score_curve(model, tokenizer, prompt, methods["snapkv"], args.layer, 0,
                                        highlight=str(PASS_KEY)),
        "budget_map": plot_budget_maps(model, tokenizer, prompt, budget_methods),
    }
    out = Path(args.figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, (fig, _) in figures.items():
        path = out / f"viz_{name}_smollm2-135m.png"
        fig.savefig(path, dpi=90)
        print(path)
    return figures


if __name__ == "__main__":
    main()
