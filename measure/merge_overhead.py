"""Time spent in the merge step during one prefill, as a share of that prefill (same process, same
prompt): an attribution that machine load cannot skew the way two separately timed prefills can.

    python measure/merge_overhead.py [--context_length 4096] [--max_capacity_prompts 256] [--method snapkv]

Prints, per merge rule, the median over 3 prefills of (merge seconds, prefill seconds) and the
prefill time relative to the same prefill without the merge step. CaM's window-attention statistic
is computed outside the merge step; measure/benchmark_latency_memory.py measures it side by side.
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

import pyramidkv.core.prefill as core  # the prefill pipeline calls merge_prompt
from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model, make_method
from pyramidkv.merging import MERGE_RULES
from pyramidkv.runner.arguments import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--method", default="snapkv")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model_path, attn_implementation="sdpa", device="cpu")
    text = (ROOT / "tests" / "prompts.py").read_text() * 40
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids[:, :args.context_length]
    spent = [0.0]
    merge_prompt = core.merge_prompt

    def timed(*a, **k):
        start = time.perf_counter()
        out = merge_prompt(*a, **k)
        spent[0] += time.perf_counter() - start
        return out

    core.merge_prompt = timed
    print(f"n = {ids.shape[1]}, {args.method} budget {args.max_capacity_prompts}, {args.threads} thread(s)")
    for rule in MERGE_RULES:
        method = make_method(args.method, budget=args.max_capacity_prompts, merge=rule)
        rows = []
        for _ in range(3):
            spent[0] = 0.0
            with compress(model, method) as patch, torch.no_grad():
                cache = patch.new_cache()
                start = time.perf_counter()
                model(ids, past_key_values=cache, use_cache=True)
                rows.append((spent[0], time.perf_counter() - start))
        merge_s, total_s = statistics.median(r[0] for r in rows), statistics.median(r[1] for r in rows)
        print(f"{rule}: merge step {merge_s:.3f} s of prefill {total_s:.2f} s -> prefill x "
              f"{total_s / (total_s - merge_s):.3f} vs no merge")


if __name__ == "__main__":
    main()
