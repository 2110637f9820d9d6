"""Time to first token of a question asked after a compressed context, against the same question inside its own
prompt (context + question prefilled with fullkv): thread CPU time, one torch thread, rows interleaved each round.

    PYTHONPATH=. python measure/question_append.py --context 4096 --questions 64 256 --rounds 2 \
        --methods fullkv snapkv:budget=256 "snapkv:budget=256,decode_budget=512" --token_by_token 64 256 \
        --token_by_token_methods fullkv snapkv:budget=256

Rows per question length q (each round: the cache put back to the compressed context, core/snapshot.py, as the
shared-context protocol does before each question; logits at the last position only, as generate computes them):
  own prompt       context + question prefilled with fullkv in one forward (the reference);
  context alone    the context prefilled with fullkv (own prompt - context alone: the question's share of it);
  METHOD, one forward     the question appended to METHOD's compressed context in one forward (this branch);
  METHOD, token by token  the question fed one token per forward (before it; only for q in --token_by_token).
Prints per q the median seconds of each row and its ratio to the own prompt and to the question's share.
"""

from __future__ import annotations

import statistics
import time

import torch

from pyramidkv import compress, load_model
from pyramidkv.core.snapshot import restore, snapshot
from pyramidkv.generation.greedy import _prompt_then_decode
from pyramidkv.methods import parse_method_spec
from pyramidkv.models.default_model import default_model_path
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.benchmarks.measure import TEXT as STORY   # filler words (a measure script does not import tests)


def text_tokens(tokenizer, n: int, offset: int = 0) -> list[int]:
    words = (STORY + " ") * (2 + 2 * (n + offset) // max(1, len(STORY.split())))
    return tokenizer(words, add_special_tokens=False).input_ids[offset:offset + n]


def main() -> None:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--context", type=int, default=4096, help="context tokens")
    ap.add_argument("--questions", type=int, nargs="+", default=[64, 256], help="question lengths in tokens")
    ap.add_argument("--token_by_token", type=int, nargs="*", default=[64], help="question lengths also fed one "
                    "token per forward (the time before this branch)")
    ap.add_argument("--methods", nargs="+", default=["fullkv", "snapkv:budget=256"], help="method specs")
    ap.add_argument("--token_by_token_methods", nargs="*", default=None, help="the methods (of --methods) timed token "
                    "by token too (default: all)")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(str(default_model_path()), attn_implementation="sdpa", device="cpu")
    context = text_tokens(tokenizer, args.context)
    fullkv = parse_method_spec("fullkv")

    def prefill(tokens, method):
        with compress(model, method) as patch, _prompt_then_decode(model, None):
            cache = patch.new_cache([tokens], tokenizer)
            model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
        return cache

    compressed = {spec: snapshot(prefill(context, parse_method_spec(spec))) for spec in args.methods}

    def appended(spec, question, pieces):
        method = parse_method_spec(spec)
        mask = torch.ones(1, len(context), dtype=torch.long)
        with compress(model, method) as patch, _prompt_then_decode(model, None):
            cache = patch.new_cache()
            restore(cache, compressed[spec])   # the compressed context, as before each shared-context question
            start, done = time.thread_time(), 0
            for piece in pieces:
                mask = torch.cat([mask, mask.new_ones(1, piece)], dim=1)
                positions = torch.arange(len(context) + done, len(context) + done + piece)[None]
                model(torch.tensor([question[done:done + piece]]), attention_mask=mask, position_ids=positions,
                      past_key_values=cache, use_cache=True)
                done += piece
            return time.thread_time() - start

    def timed(run):
        start = time.thread_time()
        run()
        return time.thread_time() - start

    for q in args.questions:
        question = text_tokens(tokenizer, q, offset=args.context + 17)
        rows = {"own prompt": lambda: timed(lambda: prefill(context + question, fullkv)),
                "context alone": lambda: timed(lambda: prefill(context, fullkv))}
        for spec in args.methods:
            rows[f"{spec}, one forward"] = lambda spec=spec: appended(spec, question, [q])
            if q in args.token_by_token and spec in (args.methods if args.token_by_token_methods is None
                                                     else args.token_by_token_methods):
                rows[f"{spec}, token by token"] = lambda spec=spec: appended(spec, question, [1] * q)
        times = {name: [] for name in rows}
        with torch.no_grad():
            prefill(context[:256], fullkv), appended(args.methods[0], question[:8], [8])   # warm-up
            for _ in range(args.rounds):
                for name, run in rows.items():
                    times[name].append(run())
        own = statistics.median(times["own prompt"])
        share = own - statistics.median(times["context alone"])
        print(f"context {len(context)} tokens, question {q} tokens, median of {args.rounds} rounds (CPU s):")
        for name, t in times.items():
            m = statistics.median(t)
            print(f"  {name:45s} {m:9.3f} s  {m / own:6.3f}x own prompt  {m / share:7.3f}x the question's share")


if __name__ == "__main__":
    main()
