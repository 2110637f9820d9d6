"""KVzip's head scores (Kim et al., 2025, arXiv 2505.23416, the head-level variant) for any supported model: the
file `kvzip_head` reads (docs/methods.md, "KVzip, head-level").

    python scripts/kvzip_head_scores.py [--model_path M] [--model_class C] [--out FILE] [--length 2000]
        [--num_samples 1] [--chunk_size 2000] [--haystack_dir DIR]

A sample: `length` tokens of the essays (sorted by file name, joined by blank lines; sample i starts where
sample i - 1 ended) as the user turn of the model's chat template, exactly `length` context tokens (one repeat chunk
at the default sizes). kvzip's repeat passes (which read the template's prefix and the context, as the authors')
score every context position of every layer and query head (core/reconstruction.py); a KV head's score is the maximum over its query
group and over the positions; several samples: the elementwise maximum (the authors'). Output [layers, KV heads]
with its record (model, data and digests, settings, CPU seconds); nothing is drawn at random. Default --out:
"{model}_kvzip-head.safetensors" (model = the last component of the model path, lowercased).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.runner.arguments import output_file
from pyramidkv.benchmarks.calibration import (Clock, add_device, calibration_parser, default_artifact,
                                               essay_folder, essay_windows, provenance, refused_before_loading,
                                               require_positive)


def sample_scores(model, tokenizer, tokens: list[int], chunk_size: int) -> torch.Tensor:
    """[L, Hkv] of one prompt (token ids, chat template applied): per layer kvzip's scores [Hq, n], maximised over
    each query group and over the positions (0 outside the context, and every score is >= 0)."""
    from pyramidkv import compress, make_method

    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    method = make_method("kvzip", budget_ratio=0.5, chunk_size=chunk_size)
    device = next(model.parameters()).device
    with torch.no_grad(), compress(model, method) as patch:
        cache = patch.new_cache([tokens], tokenizer)
        model(torch.tensor([tokens], device=device), use_cache=True, **{CACHE_ARGUMENT: cache})
    scores = cache.reconstruction.scores
    return torch.stack([scores[layer][0].reshape(kv_heads, -1).amax(-1).cpu() for layer in range(len(scores))])


def head_scores(model, tokenizer, samples: list[list[int]], chunk_size: int) -> torch.Tensor:
    """[L, Hkv]: the elementwise maximum of sample_scores over the samples."""
    return torch.stack([sample_scores(model, tokenizer, tokens, chunk_size) for tokens in samples]).amax(0)


def calibration_samples(tokenizer, folder: Path, num_samples: int, length: int) -> tuple[list[list[int]], list[dict]]:
    """(num_samples prompts: `length` essay tokens each, exactly, between the chat template's prefix and suffix
    (joined as token ids: a decode and re-encode would change the count), the sources read: [{file, sha256}]); a
    ValueError when the essays hold too few tokens."""
    from pyramidkv.methods.kvzip import template_edges

    windows, sources = essay_windows(tokenizer, folder, num_samples, length, ("--num_samples", "--length"))
    prefix, suffix = template_edges(tokenizer)
    return [prefix + window + suffix for window in windows], sources


def parse_args(argv=None) -> argparse.Namespace:
    parser = calibration_parser("kvzip_head_scores.py", __doc__)
    parser.add_argument("--out", default=None, type=output_file,
                        help="output file (default {model}_kvzip-head.safetensors), checked before the work")
    parser.add_argument("--length", type=int, default=2000, help="essay tokens per sample")
    parser.add_argument("--num_samples", type=int, default=1, help="samples (the authors' 1); their maximum is kept")
    parser.add_argument("--chunk_size", type=int, default=2000, help="kvzip's chunk_size (the authors' 2000)")
    add_device(parser)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("length", "num_samples", "chunk_size"))
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pyramidkv.components import check_output
    from pyramidkv.methods import make_method
    from pyramidkv.methods.calibrated import model_record, save_artifact
    from pyramidkv.models.loading import check_model, load_model
    from pyramidkv.models.patch import model_shape

    out = default_artifact(args, "kvzip-head")
    with refused_before_loading("kvzip_head_scores.py"):
        if args.out is None:   # a given --out is checked by its type
            check_output(out)
        path, config, _, _ = check_model(args.model_path, "sdpa", args.device, args.dtype, args.model_class)
        make_method("kvzip", budget_ratio=0.5).check_model(model_shape(config, implementation="sdpa"))   # as the runners
        folder = essay_folder(args)
        samples, sources = calibration_samples(AutoTokenizer.from_pretrained(path), folder, args.num_samples,
                                               args.length)
        longest = max(len(s) for s in samples) + args.chunk_size + 64   # the repeat passes run after the prompt
        if longest > config.max_position_embeddings:
            raise ValueError(f"--length {args.length} with its repeat passes reaches position {longest}, beyond the "
                             f"model's {config.max_position_embeddings}")
    model, tokenizer = load_model(args.model_path, attn_implementation="sdpa", device=args.device, dtype=args.dtype,
                                  model_class=args.model_class)
    clock = Clock()
    table = head_scores(model, tokenizer, samples, args.chunk_size)
    record = {"kind": "kvzip-head", "model": {**model_record(path, model.config), "name": args.model_path},
              "data": {"folder": folder.name, "sources": sources, "num_samples": args.num_samples,
                       "length": args.length, "prompt_tokens": [len(s) for s in samples]},
              "settings": {"chunk_size": args.chunk_size, "dtype": args.dtype, "reduce": "max over query group, "
                           "positions and samples"},
              "seed": None, **provenance(clock, argv)}
    save_artifact(out, {"head_scores": table}, record)
    print(f"head scores {tuple(table.shape)} in {record['cpu_seconds']} CPU s ({record['wall_seconds']} s) -> {out}")
    return out


if __name__ == "__main__":
    main()
