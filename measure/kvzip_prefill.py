"""KVzip's prefill against the plain prefill (no compression), thread CPU time, one torch thread, rows interleaved.

    PYTHONPATH=. python measure/kvzip_prefill.py --lengths 1024 4096 --rounds 3 [--old FILE]
        [--model_path DIR --device cuda --dtype bfloat16 --json FILE]

On the CPU the clock is the thread's CPU time (one torch thread); on CUDA synchronized wall time.
--json FILE: the medians and ratios per length, and the FLOP floor, for scripts/gpu_check.py.

--old FILE: a core/reconstruction.py of another commit (`git show REV:pyramidkv/core/reconstruction.py > FILE`);
its Reconstruction.attend is timed as the row "kvzip (old)" in the same process, interleaved with the others.
Prints per length the median CPU seconds of each row and its ratio to plain, and the FLOP floor: the ratio
the multiply-adds of the two give (the plain prefill's linear layers, LM head over every position as transformers
4.44.2 runs it, causal attention; the repeat's linear layers without the LM head and without the last layer's
output projection and MLP, its attention over the prompt's read keys and its own, causal, and the score's product
of every repeat query with its chunk's keys), with and without that score product.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time

import torch

from pyramidkv import compress, load_model, make_method
from pyramidkv.benchmarks.measure import chat_prompt_ids
from pyramidkv.core import reconstruction
from pyramidkv.models.default_model import default_model_path
from pyramidkv.runner.arguments import ArgumentParser


def multiply_adds(config, n: int, plans) -> tuple[int, int, int]:
    """(plain prefill, repeat passes, the repeat's score products) multiply-adds of one n-token prompt."""
    layers, h, inter = config.num_hidden_layers, config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    dim = h // heads
    out_and_mlp = heads * dim * h + 3 * h * inter
    linear = h * (heads + 2 * kv_heads) * dim + out_and_mlp        # per token and layer
    pair = 2 * heads * dim                                          # q . k and p . v, all query heads
    plain = n * (layers * linear + h * config.vocab_size) + layers * pair * n * (n + 1) // 2
    repeat = score = 0
    for plan in plans:
        read = n - plan.suffix
        for chunk in plan.chunks:
            m, width = len(chunk.ids), chunk.stop - chunk.start
            rest = read - plan.prefix - width                       # the other chunks: not read at the last layer
            repeat += m * (layers * linear - out_and_mlp)
            repeat += pair * (layers * (m * read + m * (m + 1) // 2) - m * rest)
            score += layers * heads * dim * m * width
    return plain, repeat + score, score


def main() -> None:
    ap = ArgumentParser(description=__doc__)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old", default=None)
    ap.add_argument("--model_path", default=None, help="default: the default model's converted folder")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    model, tokenizer = load_model(args.model_path or str(default_model_path()), attn_implementation="sdpa",
                                  device=args.device, dtype=args.dtype)

    def clock():
        if device.type == "cuda":
            torch.cuda.synchronize()
            return time.perf_counter()
        return time.thread_time()

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
        model(torch.tensor([tokens], device=device), use_cache=True)

    plans = {}

    def kvzip(attend):
        def run(tokens):
            reconstruction.Reconstruction.attend = attend
            try:
                with compress(model, method) as patch:
                    cache = patch.new_cache([tokens], tokenizer)
                    plans[len(tokens)] = cache.reconstruction.plans
                    model(torch.tensor([tokens], device=device), past_key_values=cache, use_cache=True)
            finally:
                reconstruction.Reconstruction.attend = new_attend
        return run

    rows = {"plain": plain, "kvzip": kvzip(new_attend)}
    if old_attend is not None:
        rows["kvzip (old)"] = kvzip(old_attend)
    report = {}
    for n in args.lengths:
        tokens = chat_prompt_ids(tokenizer, n)
        times = {name: [] for name in rows}
        with torch.no_grad():
            for name, run in rows.items():   # warm-up
                run(tokens[:256])
            for _ in range(args.rounds):
                for name, run in rows.items():
                    start = clock()
                    run(tokens)
                    times[name].append(clock() - start)
        base = statistics.median(times["plain"])
        print(f"n = {len(tokens)} tokens ({n} context), median of {args.rounds}:")
        for name, t in times.items():
            print(f"  {name:12s} {statistics.median(t):8.3f} s  {statistics.median(t) / base:5.2f}x plain")
        plain, repeat, score = multiply_adds(model.config, len(tokens), plans[len(tokens)])
        print(f"  FLOP floor  {(plain + repeat) / plain:5.2f}x plain ({(plain + repeat - score) / plain:5.2f}x without "
              f"the score's product); plain {plain / 1e9:.0f} G multiply-adds")
        report[n] = {"tokens": len(tokens), "seconds": {k: statistics.median(t) for k, t in times.items()},
                     "x_plain": {k: round(statistics.median(t) / base, 3) for k, t in times.items()},
                     "flop_floor": round((plain + repeat) / plain, 3),
                     "flop_floor_without_score": round((plain + repeat - score) / plain, 3)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "dtype": str(next(model.parameters()).dtype), "rounds": args.rounds,
                       "lengths": report}, f, indent=1)


if __name__ == "__main__":
    main()
