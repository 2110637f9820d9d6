#!/usr/bin/env python
"""A small budget sweep: pass-key accuracy and KV size per (method, budget), as a table and a plot.

Pass-key prompts (needle at several depths) answered in one batch per (method, budget); fullkv is
the reference row. Writes sweep.md (Markdown table), sweep.json and sweep.png to --out.
~40 s on a CPU with the defaults.

    python examples/sweep_and_plot.py --out results/examples [--methods snapkv pyramidkv streamingllm] [--budgets 48 96 192]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from pyramidkv import load_model, make_method
from pyramidkv.generation import generate

from pyramidkv.benchmarks.prompting import passkey_prompt
from pyramidkv.runner.arguments import ArgumentParser

KEYS = (73691, 40422, 58213)
DEPTHS = (0.1, 0.5, 0.9)


def run_sweep(model, tokenizer, methods, budgets, num_fillers) -> list[dict]:
    prompts = [passkey_prompt(tokenizer, k, num_fillers, d) for k, d in zip(KEYS, DEPTHS)]
    configs = [("fullkv", None)] + [(m, b) for m in methods for b in budgets]
    rows, full_bytes = [], None
    for name, budget in configs:
        method = make_method(name) if budget is None else make_method(name, budget=budget)
        outputs = generate(model, tokenizer, prompts, method, max_new_tokens=6)
        correct = [o.text.strip().startswith(str(k)) for o, k in zip(outputs, KEYS)]
        kv = sum(o.kv_bytes_per_prompt for o in outputs)
        full_bytes = full_bytes or kv
        rows.append({"method": name, "budget": budget, "accuracy": sum(correct) / len(correct),
                     "kv_fraction": kv / full_bytes, "answers": [o.text for o in outputs]})
    return rows


def table(rows) -> str:
    lines = ["| method | budget | pass-key accuracy | KV size (x fullkv) |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {r['budget'] or 'full'} | {r['accuracy']:.2f} | {r['kv_fraction']:.3f} |")
    return "\n".join(lines)


def plot(rows, budgets) -> plt.Figure:
    fig, ax = plt.subplots(figsize=(6.5, 4), layout="constrained")
    full = next(r for r in rows if r["method"] == "fullkv")
    ax.axhline(full["accuracy"], color="black", ls=":", label="fullkv")
    for name in dict.fromkeys(r["method"] for r in rows if r["budget"] is not None):
        mine = [r for r in rows if r["method"] == name]
        ax.plot([r["budget"] for r in mine], [r["accuracy"] for r in mine], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("budget (tokens per layer per KV head)")
    ax.set_ylabel("pass-key accuracy")
    ax.set_title("Pass-key accuracy vs budget (SmolLM2-135M)", fontsize=10)
    ax.legend(fontsize=8)
    return fig


def main(argv=None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/examples", help="folder for sweep.md, sweep.json, sweep.png")
    parser.add_argument("--methods", nargs="+", default=["snapkv", "pyramidkv", "streamingllm"])
    parser.add_argument("--budgets", nargs="+", type=int, default=[48, 96, 192])
    parser.add_argument("--num_fillers", type=int, default=8, help="prompt length (~25 tokens per filler)")
    args = parser.parse_args(argv)
    try:
        for name in args.methods:
            for budget in args.budgets:
                make_method(name, budget=budget)
    except ValueError as e:
        parser.error(str(e))
    model, tokenizer = load_model("smollm2-135m", attn_implementation="sdpa", device="cpu")
    rows = run_sweep(model, tokenizer, args.methods, args.budgets, args.num_fillers)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    markdown = table(rows)
    (out / "sweep.md").write_text(markdown + "\n", encoding="utf-8")
    (out / "sweep.json").write_text(json.dumps(rows, indent=1), encoding="utf-8")
    fig = plot(rows, args.budgets)
    fig.savefig(out / "sweep.png", dpi=100)
    print(markdown)
    print(f"wrote {out / 'sweep.md'}, {out / 'sweep.png'}")
    return {"rows": rows, "figure": fig}


if __name__ == "__main__":
    main()
