"""Calibrate TriAttention (Mao et al., 2026, arXiv 2604.04921) for any supported model: the query-centre file
`triattention` reads (docs/methods.md, "TriAttention").

    python scripts/calibrate_triattention.py [--model_path M] [--model_class C] [--out FILE] [--num_texts 2]
        [--length 1024] [--haystack_dir DIR]

Texts: the essays (sorted by file name) joined by blank lines, tokenized without special tokens and cut into
`num_texts` consecutive windows of `length` tokens (the authors use one text of up to 32,768 tokens). Per layer and
query head every position's query before RoPE (the layer's own projection and RoPE, undone with the model's
rotation), as complex pairs z_f = q[f] + i q[f + D/2]: the complex mean over every position of every text
(`q_mean_real`, `q_mean_imag`) and the mean magnitude (`q_abs_mean`), each [layers, query heads, head dim / 2],
accumulated in float64 and saved in float32 with the record (model, data and digests, settings, CPU seconds).
Default --out: "{model}_triattention.safetensors" (model = the last component of the model path, lowercased).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pyramidkv.runner.arguments import output_file
from pyramidkv.benchmarks.calibration import (Clock, add_device, calibration_parser, default_artifact,
                                               essay_folder, essay_windows, provenance, refused_before_loading,
                                               require_positive)


def pre_rope_queries(model, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer the queries [B, Hq, n, D] before RoPE of one forward of input_ids: the layer's queries as its
    attention receives them, that rotation undone at positions 0 .. n - 1 (float32; either transformers line)."""
    from pyramidkv.models.capture import pre_rope_queries as queries

    return queries(model, input_ids, "triattention's calibration")


def calibrate(model, token_lists: list[list[int]]) -> dict[str, torch.Tensor]:
    """{q_mean_real, q_mean_imag, q_abs_mean} [L, Hq, D/2] float32: per layer and query head the complex mean and
    the mean magnitude of the pre-RoPE query pairs over every position of every text (sums in float64)."""
    device = next(model.parameters()).device
    sums = total = magnitudes = None
    count = 0
    for tokens in token_lists:
        queries = pre_rope_queries(model, torch.tensor([tokens], device=device))
        q = torch.stack([layer[0] for layer in queries]).double().cpu()          # [L, Hq, n, D]
        half = q.shape[-1] // 2
        pairs = torch.complex(q[..., :half], q[..., half:])                      # [L, Hq, n, D/2]
        sums = pairs.sum(dim=2) if sums is None else sums + pairs.sum(dim=2)
        magnitudes = pairs.abs().sum(dim=2) if magnitudes is None else magnitudes + pairs.abs().sum(dim=2)
        count += q.shape[2]
    mean = sums / count
    return {"q_mean_real": mean.real.float(), "q_mean_imag": mean.imag.float(),
            "q_abs_mean": (magnitudes / count).float()}


def parse_args(argv=None) -> argparse.Namespace:
    parser = calibration_parser("calibrate_triattention.py", __doc__)
    parser.add_argument("--out", default=None, type=output_file,
                        help="output file (default {model}_triattention.safetensors), checked before the work")
    parser.add_argument("--num_texts", type=int, default=2, help="texts of --length tokens (the authors: one)")
    parser.add_argument("--length", type=int, default=1024, help="tokens per text (the authors: up to 32,768)")
    add_device(parser)
    args = parser.parse_args(argv)
    require_positive(parser, args, ("num_texts", "length"))
    return args


def main(argv=None) -> Path:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from pyramidkv.components import check_output
    from pyramidkv.methods.calibrated import model_record, save_artifact
    from pyramidkv.models.loading import check_model, load_model

    out = default_artifact(args, "triattention")
    with refused_before_loading("calibrate_triattention.py"):
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
    tensors = calibrate(model, texts)
    record = {"kind": "triattention", "model": {**model_record(path, model.config), "name": args.model_path},
              "data": {"folder": folder.name, "sources": sources, "num_texts": args.num_texts, "length": args.length},
              "settings": {"dtype": args.dtype, "pairs": "rotate_half: q[f] + i q[f + D/2]",
                           "statistics": "complex mean and mean magnitude over every position, float64 sums"},
              **provenance(clock, argv)}
    save_artifact(out, tensors, record)
    print(f"centres {tuple(tensors['q_mean_real'].shape)} in {record['cpu_seconds']} CPU s "
          f"({record['wall_seconds']} s) -> {out}")
    return out


if __name__ == "__main__":
    main()
