"""Quest vs SnapKV at tiny budgets, with the question inside the prompt or fed as decode steps (Quest's protocol).

    python measure/benchmark_quest.py --tasks passkey niah_single_1 niah_multikey_1 --lengths 2048 4096 \
        --budgets 64 128 256 --num_samples 8 [--methods quest snapkv] [--batch_size 4] [--threads 2] \
        [--out docs/benchmarks/quest_accuracy.json]

Samples: RULER's niah_single_1 / niah_multikey_1 (pyramidkv.benchmarks.ruler, offline, chat template) and a
pass-key prompt (a 7-digit key at a random depth of repeated filler, Quest's passkey task), each sized to the
length (prompt + new tokens). The question is everything from the last "\nWhat " of the prompt on (the question
sentence, the chat template's end of turn and the answer prefix): "inside" prefills the whole prompt; "decode"
prefills the context only and feeds the question token by token (pyramidkv.generation.generate(questions=...)).
fullkv runs once per sample (both protocols attend to the same tokens). Score: RULER's string_match_all (the share
of the references the answer contains); for the pass key, 1 when the key is in the answer.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from pyramidkv.benchmarks.prompting import passkey_prompt
from pyramidkv.runner.arguments import ArgumentParser, output_file

NEW_TOKENS = 24


def passkey_row(tokenizer, length: int, index: int, seed: int = 0) -> dict:
    """Quest's pass-key task: a 7-digit key at a random depth, the most filler that fits `length` with the answer."""
    rng = random.Random(seed * 100_003 + index)
    key = rng.randint(1_000_000, 9_999_999)
    depth = rng.random()

    def fits(fillers: int) -> bool:
        prompt = passkey_prompt(tokenizer, key, fillers, depth)
        return len(tokenizer(prompt, add_special_tokens=False).input_ids) + NEW_TOKENS <= length

    if not fits(1):
        raise ValueError(f"length {length} is too short for the pass-key task: its prompt with one filler line and "
                         f"{NEW_TOKENS} new tokens needs more")
    fillers = 1
    while fits(fillers * 2):
        fillers *= 2
    low, high = fillers, fillers * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return {"input": passkey_prompt(tokenizer, key, low, depth), "outputs": [str(key)]}


def rows_for(task: str, tokenizer, length: int, num_samples: int) -> list[dict]:
    if task == "passkey":
        return [passkey_row(tokenizer, length, i) for i in range(num_samples)]
    from pyramidkv.benchmarks.ruler.generate import PromptFormatter, generate_rows

    return generate_rows(task, length, num_samples, PromptFormatter(tokenizer))


def score(prediction: str, references: list[str]) -> float:
    return sum(r.lower() in prediction.lower() for r in references) / len(references)


def run(model, tokenizer, rows: list[dict], method, protocol: str, batch_size: int) -> list[float]:
    from pyramidkv.generation import generate, split_prompt

    scores = []
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        if protocol == "inside":
            outputs = generate(model, tokenizer, [r["input"] for r in batch], method, NEW_TOKENS)
        else:
            parts = [split_prompt(tokenizer, r["input"], r["input"].rindex("\nWhat ")) for r in batch]
            outputs = generate(model, tokenizer, [c for c, _ in parts], method, NEW_TOKENS,
                               questions=[q for _, q in parts])
        scores += [score(o.text, r["outputs"]) for o, r in zip(outputs, batch)]
    return scores


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["passkey", "niah_single_1", "niah_multikey_1"])
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 4096])
    parser.add_argument("--budgets", nargs="+", type=int, default=[64, 128, 256])
    parser.add_argument("--methods", nargs="+", default=["quest", "snapkv"])
    parser.add_argument("--protocols", nargs="+", default=["inside", "decode"], choices=["inside", "decode"])
    parser.add_argument("--num_samples", type=int, default=8)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, type=output_file)
    args = parser.parse_args(argv)
    for flag in ("lengths", "budgets"):
        bad = [n for n in getattr(args, flag) if n < 1]
        if bad:
            parser.error(f"--{flag} {' '.join(map(str, bad))}: at least 1")
    for flag in ("num_samples", "batch_size", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag} {value}: at least 1")
    from pyramidkv.methods import make_method
    from pyramidkv.models.default_model import default_model_path
    from pyramidkv.models.loading import load_model

    methods = {}
    for name in args.methods:
        for budget in args.budgets:
            try:
                methods[name, budget] = make_method(name, budget=budget)
            except ValueError as e:
                parser.error(f"--methods {name} with --budgets {budget}: {e}")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    samples = {}
    for task in args.tasks:         # every prompt before the model loads: a bad task or length is refused now
        for length in args.lengths:
            try:
                samples[task, length] = rows_for(task, tokenizer, length, args.num_samples)
            except (ValueError, KeyError) as e:
                parser.error(f"--tasks {task} at --lengths {length}: {str(e).strip(chr(39))}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_model(attn_implementation="sdpa", device="cpu")
    results = {"arguments": vars(args), "threads": torch.get_num_threads(), "new_tokens": NEW_TOKENS, "rows": []}
    for task in args.tasks:
        for length in args.lengths:
            rows = samples[task, length]
            configs = [("fullkv", None, "inside")] + [(m, b, p) for m in args.methods for b in args.budgets
                                                       for p in args.protocols]
            for name, budget, protocol in configs:
                method = make_method(name) if budget is None else methods[name, budget]
                started = time.time()
                scores = run(model, tokenizer, rows, method, protocol, args.batch_size)
                row = {"task": task, "length": length, "method": name, "budget": budget, "protocol": protocol,
                       "samples": len(scores), "score": sum(scores) / len(scores), "per_sample": scores,
                       "seconds": round(time.time() - started, 1)}
                results["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "per_sample"}), flush=True)
                if args.out:
                    Path(args.out).write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
