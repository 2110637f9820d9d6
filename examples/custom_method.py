#!/usr/bin/env python
"""Mean key distance (an example method): keep the keys farthest from their head's mean key.

A new scoring method in 9 lines, registered with `register_method`, it shows up in the method listing, builds with `make_method`,
runs with every budget allocator that exists (pyramidkv.allocation) and through the batch API
(`generate`), with no change to the core. ~20 s on a CPU.

    python examples/custom_method.py [--budget 64] [--out kept.json]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

from pyramidkv import load_model, make_method
from pyramidkv.methods import Method, register_method
from pyramidkv.methods.__main__ import method_table

from pyramidkv.benchmarks.prompting import passkey_prompt
from pyramidkv.runner.arguments import ArgumentParser


# ---- the method: 9 lines ------------------------------------------------------------------------------
@dataclass(frozen=True)
class MeanKeyDistance(Method):
    """Score = L2 distance of each key to its head's mean key over the real prompt tokens."""
    name = "mean_key_distance"

    def score(self, ctx):
        keys, real = ctx.keys.float(), ctx.real[:, None, :, None]  # [B, Hkv, n, D], [B, 1, n, 1]
        mean = (keys * real).sum(2, keepdim=True) / real.sum(2, keepdim=True)
        return (keys - mean).norm(dim=-1)  # [B, Hkv, n], higher = keep
register_method(MeanKeyDistance)  # noqa: E305
# -------------------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the kept positions (per layer, per head) as JSON")
    args = parser.parse_args(argv)
    try:
        make_method(MeanKeyDistance.name, budget=args.budget)
    except ValueError as e:
        parser.error(f"--budget {args.budget}: {e}")

    from pyramidkv.viz import allocation_variants, prefill, tokenize
    from pyramidkv.generation import generate

    print(method_table())  # the registry listing, now with mean_key_distance
    model, tokenizer = load_model("smollm2-135m", attn_implementation="sdpa", device="cpu")
    prompt = passkey_prompt(tokenizer, 73691, num_fillers=12)
    tokens = tokenize(tokenizer, prompt)

    variants = allocation_variants(MeanKeyDistance.name, budget=args.budget)
    result = {"method": MeanKeyDistance.name, "budget": args.budget, "prompt_ids": tokens.ids, "allocations": {}}
    for label, method in variants.items():
        run = prefill(model, tokens, method)
        result["allocations"][label] = {"window_size": method.window_size, "layer_budgets": run.layer_budgets,
                                        "kept": [[p.tolist() for p in heads] for heads in run.kept]}
        print(f"{label}: kept {int(run.counts.sum())} tokens over {len(run.kept)} layers x {run.num_heads} heads")

    # The batch API: two prompts, left-padded into one batch, each answers as it does alone.
    prompts = [passkey_prompt(tokenizer, 73691, num_fillers=12, depth=0.9), passkey_prompt(tokenizer, 40422, num_fillers=6, depth=0.5)]
    method = make_method(MeanKeyDistance.name, budget=args.budget)
    batch = generate(model, tokenizer, prompts, method, max_new_tokens=6)
    alone = [generate(model, tokenizer, [p], method, max_new_tokens=6)[0] for p in prompts]
    for b, a in zip(batch, alone):
        assert b.text == a.text, (b.text, a.text)
        print(f"batch answer {b.text!r} ({b.prompt_tokens} prompt tokens, {b.kv_bytes_per_prompt} KV bytes)")
    result["batch_answers"] = [b.text for b in batch]
    if args.out:
        Path(args.out).write_text(json.dumps(result), encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
