"""What every way of decoding a run's samples shares: batches, the loaded model, the fields a row adds where the
budget is an outcome."""

from __future__ import annotations

from pathlib import Path

from pyramidkv.runner.cli import apply_num_threads


def load_run_model(args, out_dir: Path):
    """(model, tokenizer) as the run's flags ask, loaded when the first sample is pending; a device map's
    placement is recorded in the run folder."""
    from pyramidkv.models.loading import load_model
    from pyramidkv.runner.results import record_placement

    apply_num_threads(args)
    model, tokenizer = load_model(args.model_path, attn_implementation=args.attn_implementation, device=args.device,
                                  dtype=args.dtype, model_class=args.model_class, device_map=args.device_map)
    if args.device_map is not None:
        record_placement(out_dir, model.hf_device_map)
    return model, tokenizer


def achieved(output) -> dict:
    """The fields a prediction row adds where the budget is an outcome (head_allocation threshold; else none): per
    layer and stored head the tokens held, the tokens seen (prompt + fed), and the kept share of them overall
    (mean over layers and heads) and per layer: what was achieved, never a nominal budget."""
    held, seen = output.held_tokens, output.seen_tokens
    if held is None:
        return {}
    per_layer = [sum(heads) / (len(heads) * seen) for heads in held]
    return {"held_tokens": held, "seen_tokens": seen, "kept_share": round(sum(per_layer) / len(per_layer), 6),
            "kept_share_per_layer": [round(x, 6) for x in per_layer]}


def block_fields(output) -> dict:
    """The fields every prediction row adds: per block size the share of the full cache's blocks a paged engine
    could free when the answer ended (`block_free_16`, `block_free_32`; sizing/blocks.py); none where the
    generation did not record them. With --prefill_chunk_size also the chunks the prompt was prefilled in (1: the
    prompt fit in one chunk, nothing was chunked) and the peak K/V bytes during the prefill."""
    free = getattr(output, "block_free", None)
    fields = {} if not free else {f"block_free_{size}": share for size, share in free.items()}
    if getattr(output, "prefill_chunks", None) is not None:   # with --prefill_chunk_size: what the prefill did
        fields.update(prefill_chunks=output.prefill_chunks, peak_prefill_kv_bytes=output.peak_prefill_kv_bytes)
    return fields


def batches(samples: list, size: int, by_length: bool = False) -> list[list]:
    """Batches of at most `size` samples, each of one max_new_tokens and one batch_group, in the given order;
    with by_length (and size > 1) longest prompt first, so a batch holds prompts of near lengths: little left
    padding to compute (under sdpa a padded batch's prompt forward runs each prompt alone, causally; under eager
    the padding is computed and masked). Within a batch the samples keep their given order."""
    groups: dict[tuple, list[tuple[int, object]]] = {}
    for given, sample in enumerate(samples):
        groups.setdefault((sample.max_new_tokens, sample.batch_group), []).append((given, sample))
    out = []
    for group in groups.values():
        if by_length and size > 1:
            group = sorted(group, key=lambda item: -len(item[1].prompt))   # stable: equal lengths keep their order
        for start in range(0, len(group), size):
            out.append([sample for _, sample in sorted(group[start:start + size], key=lambda item: item[0])])
    return out
