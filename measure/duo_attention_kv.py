"""DuoAttention's KV on the default model against the removed-share formula (docs/methods.md, "DuoAttention").

    OMP_NUM_THREADS=1 python measure/duo_attention_kv.py [--tokens 2048] [--new_tokens 8]

A prompt of the first `tokens` tokens of the needle data's essays; fullkv, then duo_attention (shipped pattern) at
streaming shares 0.5 and 0.75 under both head selections: the share of heads streaming, the share of the cache
removed (held tokens) next to removed_share(), KV MiB, and whether the greedy text equals fullkv's.
"""

from __future__ import annotations

import argparse
import time

import torch

from pyramidkv.runner.arguments import ArgumentParser


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--new_tokens", type=int, default=8)
    args = parser.parse_args(argv)
    from pyramidkv import load_model, make_method
    from pyramidkv.benchmarks.prompting import essay_dir
    from pyramidkv.generation import generate
    from pyramidkv.methods.duo_attention import removed_share

    torch.set_num_threads(1)
    model, tokenizer = load_model("smollm2-135m", attn_implementation="sdpa", device="cpu")
    text = "".join(p.read_text() for p in sorted(essay_dir().glob("*.txt"))[:3])
    ids = tokenizer(text, add_special_tokens=False).input_ids[:args.tokens]
    full = generate(model, tokenizer, [ids], make_method("fullkv"), args.new_tokens, stop_token_ids=[])[0]
    for share in (0.5, 0.75):
        for rule in ("quantile", "argsort"):
            method = make_method("duo_attention", streaming_share=share, duo_selection=rule)
            started = time.time()
            out = generate(model, tokenizer, [ids], method, args.new_tokens, stop_token_ids=[])[0]
            cells = [c for row in out.held_tokens for c in row]
            streaming = sum(c < out.seen_tokens for c in cells) / len(cells)
            removed = 1 - sum(cells) / (len(cells) * out.seen_tokens)
            formula = removed_share(streaming, method.num_sinks, method.window_size, out.seen_tokens)
            print(f"share {share} {rule}: heads streaming {streaming:.3f}, cache removed {removed:.4f} (formula "
                  f"{formula:.4f}), KV {out.kv_bytes_per_prompt / 2 ** 20:.2f} MiB (fullkv "
                  f"{full.kv_bytes_per_prompt / 2 ** 20:.2f}), text as fullkv's: {out.text == full.text}, "
                  f"{time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
