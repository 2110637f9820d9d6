#!/usr/bin/env python
"""The Python API on a batch of prompts: one left-padded batch, greedy, under a compression method.

Three prompts of different lengths (two pass-key prompts and a short question) answered with
snapkv at a small budget, next to fullkv, with the KV bytes each prompt stores. ~15 s on a CPU.

    python examples/batch_generate.py [--method snapkv] [--budget 64]
"""

from __future__ import annotations

import argparse

from pyramidkv import load_model, make_method
from pyramidkv.generation import generate

from pyramidkv.benchmarks.prompting import passkey_prompt
from pyramidkv.runner.arguments import ArgumentParser


def main(argv=None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--max_new_tokens", type=int, default=8)
    args = parser.parse_args(argv)
    try:
        compressed = make_method(args.method, budget=args.budget)
    except ValueError as e:
        parser.error(f"--method {args.method} --budget {args.budget}: {e}")

    model, tokenizer = load_model("smollm2-135m", attn_implementation="sdpa", device="cpu")
    question = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                             tokenize=False, add_generation_prompt=True)
    prompts = [passkey_prompt(tokenizer, 73691, num_fillers=12, depth=0.9), passkey_prompt(tokenizer, 40422, num_fillers=6), question]
    methods = {"fullkv": make_method("fullkv"), args.method: compressed}
    outputs = {}
    for name, method in methods.items():
        outputs[name] = generate(model, tokenizer, prompts, method, max_new_tokens=args.max_new_tokens)
    print(f"{'prompt':>6} {'tokens':>6} | " + " | ".join(f"{n:>28}" for n in methods))
    for i, _ in enumerate(prompts):
        cells = [f"{outputs[n][i].text[:16]!r:>18} {outputs[n][i].kv_bytes_per_prompt / 2**20:5.2f} MiB" for n in methods]
        print(f"{i:>6} {outputs['fullkv'][i].prompt_tokens:>6} | " + " | ".join(cells))
    return outputs


if __name__ == "__main__":
    main()
