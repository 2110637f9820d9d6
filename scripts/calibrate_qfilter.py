"""Calibrate Q-Filters (Godey et al., 2025, arXiv 2503.02812) for any supported model: the filters file
`qfilter` reads (docs/methods.md, "Q-Filters").

    python scripts/calibrate_qfilter.py [--model_path M] [--model_class C] [--out FILE] [--num_texts 2]
        [--length 2048] [--num_svd_samples 3000] [--seed 0] [--haystack_dir DIR]

Texts: the essays (sorted by file name) joined by blank lines, tokenized without special tokens and cut into
`num_texts` consecutive windows of `length` tokens. Per layer and query head the post-RoPE queries of every
position are pooled and `num_svd_samples` of them kept at random (seeded); an uncentred SVD in float32 gives v1,
the first right singular vector; s = +1 if more than half the samples have a positive coordinate on u1, else -1;
the head's filter is -s v1, and a KV head's the mean over its query group: [layers, KV heads, head dim], saved
with its record (model, data and digests, settings, seed, CPU seconds). Default --out:
"{model}_qfilter.safetensors" (model = the last component of the model path, lowercased).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from tqdm import tqdm

from pyramidkv.runner.arguments import output_file
from pyramidkv.benchmarks.calibration import (Clock, add_device, calibration_parser, default_artifact,
                                               essay_folder, essay_windows, provenance, refused_before_loading,
                                               require_positive)


def post_rope_queries(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer the queries [B, Hq, n, D] after RoPE of one forward of input_ids, as the layer's attention receives
    them (float32; either transformers line)."""
    from pyramidkv.models.capture import post_rope_queries as queries

    return queries(model, input_ids)


def head_filter(samples: torch.Tensor) -> torch.Tensor:
    """The filter [D] of one query head from its samples [N, D]: -s v1 (uncentred SVD in float32, s the majority
    sign of the samples' coordinates on u1)."""
    u, _, vh = torch.linalg.svd(samples.float(), full_matrices=False)
    sign = 1.0 if (u[:, 0] > 0).sum().item() > samples.shape[0] / 2 else -1.0
    return -sign * vh[0]


def calibrate(model, token_lists: list[list[int]], num_svd_samples: int, seed: int) -> torch.Tensor:
    """Filters [L, Hkv, D] from texts of equal length: per (layer, query head) min(num_svd_samples, all) positions
    drawn without replacement from the pooled positions (one seeded draw per head, layer by layer), then
    head_filter, then the mean over each KV group."""
    config = model.config
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    length = len(token_lists[0])
    total = len(token_lists) * length
    keep = min(num_svd_samples, total)
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.stack([torch.randperm(total, generator=generator)[:keep] for _ in range(layers * heads)])
    chosen = chosen.view(layers, heads, keep)                                     # pooled row indices
    samples = None
    device = next(model.parameters()).device
    for t, tokens in enumerate(tqdm(token_lists, desc="texts (one forward pass each)", unit="text", dynamic_ncols=True)):
        queries = post_rope_queries(model, torch.tensor([tokens], device=device))
        if samples is None:
            samples = torch.zeros(layers, heads, keep, queries[0].shape[-1])
        for layer, q in enumerate(queries):
            for head in range(heads):
                slots = ((chosen[layer, head] >= t * length) & (chosen[layer, head] < (t + 1) * length)).nonzero()[:, 0]
                samples[layer, head, slots] = q[0, head, chosen[layer, head, slots] - t * length].cpu()
    filters = torch.stack([torch.stack([head_filter(samples[layer, head]) for head in range(heads)])
                           for layer in range(layers)])                           # [L, Hq, D]
    return filters.view(layers, kv_heads, heads // kv_heads, -1).mean(2)


def parse_args(argv=None) -> argparse.Namespace:
    parser = calibration_parser("calibrate_qfilter.py", __doc__)
    parser.add_argument("--out", default=None, type=output_file,
                        help="output file (default {model}_qfilter.safetensors), checked before the work")
    parser.add_argument("--num_texts", type=int, default=2, help="texts of --length tokens (the authors' 19)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per text (the authors' 2048)")
    parser.add_argument("--num_svd_samples", type=int, default=3000, help="queries per head (the authors' 3000)")
    parser.add_argument("--seed", type=int, default=0)
    add_device(parser)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("num_texts", "length", "num_svd_samples"))
    if args.num_texts * args.length < args.num_svd_samples:   # each head's SVD would read fewer queries than asked
        parser.error(f"--length {args.length}: {args.num_texts} texts x {args.length} tokens = "
                     f"{args.num_texts * args.length} queries per head, fewer than the --num_svd_samples "
                     f"{args.num_svd_samples} each head's SVD reads; give --length >= "
                     f"{-(-args.num_svd_samples // args.num_texts)} (or more --num_texts, or fewer --num_svd_samples)")
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pyramidkv.components import check_output
    from pyramidkv.methods.calibrated import model_record, save_artifact
    from pyramidkv.models.loading import check_model, load_model

    out = default_artifact(args, "qfilter")
    with refused_before_loading("calibrate_qfilter.py"):
        if args.out is None:
            check_output(out)
        path, config, _, _ = check_model(args.model_path, "sdpa", args.device, args.dtype, args.model_class)
        if args.length > config.max_position_embeddings:
            raise ValueError(f"--length {args.length} exceeds the model's {config.max_position_embeddings} positions")
        folder = essay_folder(args)
        texts, sources = essay_windows(AutoTokenizer.from_pretrained(path), folder, args.num_texts, args.length)
    model, _ = load_model(args.model_path, attn_implementation="sdpa", device=args.device, dtype=args.dtype,
                          model_class=args.model_class)
    clock = Clock()
    filters = calibrate(model, texts, args.num_svd_samples, args.seed)
    record = {"kind": "qfilter", "model": {**model_record(path, model.config), "name": args.model_path},
              "data": {"folder": folder.name, "sources": sources, "num_texts": args.num_texts, "length": args.length},
              "settings": {"num_svd_samples": args.num_svd_samples, "dtype": args.dtype, "svd": "float32, uncentred"},
              "seed": args.seed, **provenance(clock, argv)}
    save_artifact(out, {"filters": filters}, record)
    print(f"filters {tuple(filters.shape)} in {record['cpu_seconds']} CPU s ({record['wall_seconds']} s) -> {out}")
    return out


if __name__ == "__main__":
    main()
