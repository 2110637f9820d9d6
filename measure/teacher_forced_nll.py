"""Mean negative log-likelihood of a text continuation, teacher forced, under several method specs,
each as a ratio to fullkv measured in the same run.

    python measure/teacher_forced_nll.py --context_length 4096 --continuation 256 \
        --methods fullkv fullkv:quant_method=kivi,nbits=2 snapkv:quant_method=kivi,nbits=2 \
        --data_file path/to/LongBench/data/multi_news.jsonl

The text is real English news: the contexts of a LongBench JSONL file (--data_file, e.g. the official
multi_news.jsonl), concatenated until context_length + continuation tokens. The first context_length
tokens are the prompt (compressed by the method at prefill); the continuation is then fed one token
per step through the compressed (and possibly quantized) cache, and the NLL of each next token is
averaged. Method specs as in measure/benchmark_latency_memory.py (NAME:setting=value,...).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pyramidkv import DEFAULT_MODEL_NAME, compress, load_model
from pyramidkv.benchmarks.measure import method_from_spec
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.results import atomic_write_json, read_jsonl


def text_ids(tokenizer, data_file: Path, tokens: int) -> torch.Tensor:
    ids: list[int] = []
    for row in read_jsonl(data_file):
        ids += tokenizer(row["context"].replace("NEWLINE_CHAR", "\n") + "\n\n", add_special_tokens=False).input_ids
        if len(ids) >= tokens:
            return torch.tensor([ids[:tokens]])
    raise ValueError(f"{data_file} holds only {len(ids)} tokens; {tokens} needed")


@torch.no_grad()
def mean_nll(model, ids: torch.Tensor, method, context_length: int) -> float:
    with compress(model, method) as patch:
        cache = patch.new_cache()
        out = model(ids[:, :context_length], use_cache=True, **{CACHE_ARGUMENT: cache})
        logits = out.logits[:, -1]
        total, count = 0.0, 0
        for pos in range(context_length, ids.shape[1]):
            total += float(torch.nn.functional.cross_entropy(logits.float(), ids[:, pos]))
            count += 1
            if pos + 1 < ids.shape[1]:
                logits = model(ids[:, pos:pos + 1], past_key_values=cache, use_cache=True).logits[:, -1]
    return total / count


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--context_length", type=int, default=4096)
    parser.add_argument("--continuation", type=int, default=256)
    parser.add_argument("--max_capacity_prompts", type=int, default=256)
    parser.add_argument("--methods", nargs="+", default=["fullkv", "fullkv:quant_method=kivi,nbits=2"])
    parser.add_argument("--data_file", type=Path, required=True,
                        help="a LongBench JSONL file whose contexts are the text (e.g. multi_news.jsonl)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    data_file = args.data_file
    if not data_file.is_file():
        parser.error(f"--data_file {data_file}: no such file")
    specs = ["fullkv"] + [m for m in args.methods if m != "fullkv"]
    try:
        methods = {spec: method_from_spec(spec, args.max_capacity_prompts, "kv_head") for spec in specs}
    except ValueError as error:
        parser.error(str(error))
    model, tokenizer = load_model(args.model_path, attn_implementation="sdpa", device="cpu")
    ids = text_ids(tokenizer, data_file, args.context_length + args.continuation)
    rows = {spec: {"mean_nll": mean_nll(model, ids, method, args.context_length)} for spec, method in methods.items()}
    for row in rows.values():
        row["ratio_to_fullkv"] = row["mean_nll"] / rows["fullkv"]["mean_nll"]
    print(f"\nmean NLL of {args.continuation} teacher-forced tokens after {args.context_length} prompt tokens "
          f"({data_file.name}), budget {args.max_capacity_prompts}\n")
    print("| method | mean NLL | x fullkv |\n|---|---|---|")
    for spec, row in rows.items():
        print(f"| {spec} | {row['mean_nll']:.4f} | {row['ratio_to_fullkv']:.4f} |")
    if args.out:
        atomic_write_json(args.out, {"arguments": {k: str(v) for k, v in vars(args).items()}, "results": rows})


if __name__ == "__main__":
    main()
