"""KVzip's prefill against the plain prefill (no compression), thread CPU time, one torch thread, rows interleaved.

    PYTHONPATH=. python measure/kvzip_prefill.py --lengths 1024 4096 --rounds 3 [--old FILE]

--old FILE: a core/reconstruction.py of another commit (`git show REV:pyramidkv/core/reconstruction.py > FILE`);
its Reconstruction.attend is timed as the row "kvzip (old)" in the same process, interleaved with the others.
Prints per length the median CPU seconds of each row and its ratio to plain.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.core import reconstruction
from pyramidkv.models.default_model import default_model_path
from pyramidkv.runner.arguments import ArgumentParser
from tests.prompts import STORY


def prompt(tokenizer, n: int) -> list[int]:
    words = (STORY + " ") * (1 + 2 * n // max(1, len(STORY.split())))
    text = tokenizer.decode(tokenizer(words, add_special_tokens=False).input_ids[:n])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False).input_ids


def main() -> None:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tokenizer = load_model(str(default_model_path()), attn_implementation="sdpa", device="cpu")
    new_attend = reconstruction.Reconstruction.attend
    old_attend = None
    if args.old:
        spec = importlib.util.spec_from_file_location("old_reconstruction", args.old)
        old = importlib.util.module_from_spec(spec)
        sys.modules["old_reconstruction"] = old   # its dataclasses look their module up
        spec.loader.exec_module(old)
        old_attend = old.Reconstruction.attend
    method = make_method("kvzip", budget_ratio=0.3)

    def plain(tokens):
        model(torch.tensor([tokens]), use_cache=True)

    def kvzip(attend):
        def run(tokens):
            reconstruction.Reconstruction.attend = attend
            try:
                with compress(model, method) as patch:
                    cache = patch.new_cache([tokens], tokenizer)
                    model(torch.tensor([tokens]), past_key_values=cache, use_cache=True)
            finally:
                reconstruction.Reconstruction.attend = new_attend
        return run

    rows = {"plain": plain, "kvzip": kvzip(new_attend)}
    if old_attend is not None:
        rows["kvzip (old)"] = kvzip(old_attend)
    for n in args.lengths:
        tokens = prompt(tokenizer, n)
        times = {name: [] for name in rows}
        with torch.no_grad():
            for name, run in rows.items():   # warm-up
                run(tokens[:256])
            for _ in range(args.rounds):
                for name, run in rows.items():
                    start = time.thread_time()
                    run(tokens)
                    times[name].append(time.thread_time() - start)
        base = statistics.median(times["plain"])
        print(f"n = {len(tokens)} tokens ({n} context), median of {args.rounds}:")
        for name, t in times.items():
            print(f"  {name:12s} {statistics.median(t):8.3f} s  {statistics.median(t) / base:5.2f}x plain")


if __name__ == "__main__":
    main()
