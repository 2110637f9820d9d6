"""Quickstart: a ~1500-token pass-key prompt on the embedded SmolLM2-135M-Instruct, answered with
the full cache and with SnapKV at budget 128; prints each answer and the KV cache it kept.

    python scripts/quickstart.py [--model_path DIR] [--budget 128]
"""

from __future__ import annotations

import argparse
import time

import torch

from pyramidkv import DEFAULT_MODEL_NAME, load_model, make_method
from pyramidkv.benchmarks.prompting import passkey_prompt
from pyramidkv.generation import generate
from pyramidkv.runner.arguments import ArgumentParser

def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--budget", type=int, default=128)
    parser.add_argument("--key", type=int, default=73691)
    args = parser.parse_args()
    try:
        snapkv = make_method("snapkv", budget=args.budget)
    except ValueError as e:
        parser.error(f"--budget {args.budget}: {e}")

    torch.manual_seed(0)
    t0 = time.time()
    model, tokenizer = load_model(args.model_path, attn_implementation="sdpa", device="cpu")
    print(f"loaded {args.model_path} in {time.time() - t0:.1f}s")
    prompt = passkey_prompt(tokenizer, args.key, num_fillers=60)
    n = len(tokenizer(prompt, add_special_tokens=False).input_ids)
    cfg = model.config
    print(f"prompt: {n} tokens, pass key {args.key}; model: {cfg.num_hidden_layers} layers, "
          f"{cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads")
    full_bytes = None
    for method in (make_method("fullkv"), snapkv):
        t0 = time.time()
        out = generate(model, tokenizer, [prompt], method, max_new_tokens=8)[0]
        seconds = time.time() - t0
        kv = out.kv_bytes_per_prompt
        full_bytes = full_bytes or kv
        kept = n if method.budget is None else min(n, method.budget)
        verdict = "correct" if out.text.strip().startswith(str(args.key)) else "WRONG"
        print(f"{method.name:>8}: answer {out.text.strip()!r} ({verdict}); kept {kept} prompt tokens per layer per "
              f"KV head; KV cache {kv / 2**20:.2f} MiB ({kv / full_bytes:.3f} of fullkv); {seconds:.1f}s")


if __name__ == "__main__":
    main()
