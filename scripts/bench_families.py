"""What the patch costs on each model family: prefill and decode ms/token of fullkv and snapkv against the
unpatched model, measured side by side in one run (docs/models.md, "Benchmarks").

    python scripts/bench_families.py [--models tiny-llama smollm2-135m ...] [--repeats 5] [--threads 1]

Models: a tiny random instance of every family in MODEL_GLUE (read when the script runs: 2 layers, hidden 64,
GQA 4 / 2 heads, vocabulary 96; a 512-token prompt) and the default model (SmolLM2-135M; 1,024 tokens). Each
repeat runs the unpatched model, fullkv and snapkv (budget 128) one after the other on one random prompt
(interleaved, so a machine slowing down weighs on all three alike), each as two greedy generate() calls:
1 new token (prefill ms/token = its time / prompt tokens) and 33 (decode ms/token = the difference / 32).
The table gives the unpatched model's medians and the patched / unpatched ratios of the medians.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model, make_method
from pyramidkv.models.patch import MODEL_GLUE
from pyramidkv.runner.arguments import ArgumentParser

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)
# What a family's tiny config needs besides TINY: token ids inside the vocabulary, a few experts.
FAMILY_SETTINGS = {"phi3": dict(pad_token_id=0, bos_token_id=1, eos_token_id=2),
                   "mixtral": dict(num_local_experts=4, num_experts_per_tok=2), "gemma2": dict(pad_token_id=0)}
PROMPT = {"tiny": 512, "default": 1024}
NEW_TOKENS = 32
VARIANTS = ("unpatched", "fullkv", "snapkv")


def model_names() -> list[str]:
    return [f"tiny-{family}" for family in MODEL_GLUE] + [DEFAULT_MODEL_NAME]


def build(name: str, implementation: str):
    """(model, prompt tokens) of a model name."""
    if name == DEFAULT_MODEL_NAME:
        model, _ = load_model(name, attn_implementation=implementation, device="cpu")
        return model, PROMPT["default"]
    family = name.removeprefix("tiny-")
    glue = MODEL_GLUE[family]
    torch.manual_seed(0)
    config = glue.config_class(**TINY, **FAMILY_SETTINGS.get(family, {}))
    config._attn_implementation = implementation
    return glue.causal_lm(config).eval(), PROMPT["tiny"]


def timed_generate(model, ids, method, new_tokens: int) -> float:
    settings = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens, do_sample=False, temperature=None, top_p=None, top_k=None,
                    pad_token_id=0)
    start = time.perf_counter()
    with torch.no_grad():
        if method is None:
            model.generate(**settings)
        else:
            with compress(model, method):
                model.generate(**settings)
    return time.perf_counter() - start


def measure(model, n: int, repeats: int) -> dict[str, tuple[float, float]]:
    """{variant: (prefill ms/token, decode ms/token)}, medians over the repeats (after one warm-up round)."""
    methods = {"unpatched": None, "fullkv": make_method("fullkv"), "snapkv": make_method("snapkv", budget=128)}
    ids = torch.randint(3, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[tuple[float, float]]] = {v: [] for v in VARIANTS}
    for repeat in range(repeats + 1):
        for variant in VARIANTS:
            first = timed_generate(model, ids, methods[variant], 1)
            whole = timed_generate(model, ids, methods[variant], NEW_TOKENS + 1)
            if repeat:
                times[variant].append((1000 * first / n, 1000 * (whole - first) / NEW_TOKENS))
    return {v: (statistics.median(t[0] for t in times[v]), statistics.median(t[1] for t in times[v]))
            for v in VARIANTS}


def main(argv=None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"default: all of {', '.join(model_names())}")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (on a shared CPU more threads wait on each other: 1)")
    parser.add_argument("--attn_implementation", default="sdpa", choices=["eager", "sdpa"])
    args = parser.parse_args(argv)
    names = args.models or model_names()
    unknown = [n for n in names if n not in model_names()]
    if unknown:
        parser.error(f"--models {unknown[0]}: choose from {', '.join(model_names())}")
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: at least 1")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: at least 1")
    torch.set_num_threads(args.threads)
    logging.getLogger("pyramidkv.models.patch").setLevel(logging.ERROR)   # once per compress(): noise here
    print(f"{args.attn_implementation}, {torch.get_num_threads()} threads, {args.repeats} repeats (median), "
          f"{NEW_TOKENS} new tokens, snapkv budget 128")
    header = ("model", "prompt", "prefill ms/tok", "fullkv x", "snapkv x", "decode ms/tok", "fullkv x", "snapkv x")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for name in names:
        model, n = build(name, args.attn_implementation)
        result = measure(model, n, args.repeats)
        (prefill, decode), rows = result["unpatched"], [name, str(n)]
        rows += [f"{prefill:.3f}", *(f"{result[v][0] / prefill:.2f}" for v in VARIANTS[1:])]
        rows += [f"{decode:.2f}", *(f"{result[v][1] / decode:.2f}" for v in VARIANTS[1:])]
        print("| " + " | ".join(rows) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
