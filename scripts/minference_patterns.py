"""Search MInference's per-head prefill patterns for any supported model, on CPU; write MInference's JSON layout.

    python scripts/minference_patterns.py --model_path M [--model_class C] --out FILE [--context_length 4096]
        [--selection official|cheapest] [--min_recall 0.95] [--rows_from R] [--threads N]

One calibration prompt (a RULER niah_multikey_1 sample: an essay haystack with needles, built offline) is
run once; per layer and query head the dense causal attention P (the model's own scale, soft-cap and sliding
window: its glue's attention_form) of its rows >= R (default min(2500, n / 2),
the official search scores rows from 2500) is compared with each candidate pattern's mask, built by the
same code the runtime uses (pyramidkv.sparse_prefill). recall = mean over those rows of the attention mass
inside the mask; density = computed entries / causal entries over all rows.

Candidates (the official search's list): A-shape (100, 800); vertical-slash (30, 800), (100, 750),
(500, 700), (3500, 100); block-sparse (top-100 blocks of 64).
  official  the candidate of highest recall, then the official remapping: an A-shape winner is written as
            vertical_and_slash with the same sizes, a block-sparse winner as (vertical_and_slash, 1000, 6096),
            as MInference's `search_pattern` does (so every head is vertical-slash, like its shipped tables);
  cheapest  the lowest-density candidate with recall >= --min_recall (else the highest recall), its own type.
The score written in each entry is the chosen candidate's recall.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from pyramidkv.runner.arguments import ArgumentParser, output_file


CANDIDATES = [("stream_llm", 100, 800), ("vertical_and_slash", 30, 800), ("vertical_and_slash", 100, 750),
              ("vertical_and_slash", 500, 700), ("vertical_and_slash", 3500, 100), ("block_sparse", 0, 0)]


def calibration_ids(tokenizer, length: int) -> list[int]:
    from pyramidkv.benchmarks.ruler.generate import PromptFormatter, generate_sample

    row = generate_sample("niah_multikey_1", length, 0, PromptFormatter(tokenizer))
    return tokenizer(row["input"], add_special_tokens=False).input_ids


def layer_qk(model, ids: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer the post-RoPE queries [Hq, n, D] and keys [Hkv, n, D] of one plain forward of ids [1, n]."""
    from pyramidkv.models.glue import decoder
    from pyramidkv.models.patch import MODEL_GLUE

    glue = MODEL_GLUE[model.config.model_type]
    queries, keys = {}, {}

    def grab(module, args, kwargs):
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        q, k, _ = glue.project_qkv(module, hidden, kwargs.get("position_ids"), kwargs.get("position_embeddings"))
        queries[module.layer_idx], keys[module.layer_idx] = q[0], k[0]

    hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in decoder(model).layers]
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [queries[i] for i in range(len(queries))], [keys[i] for i in range(len(keys))]


def dense_probs(glue, model, layer: int, q: torch.Tensor, k: torch.Tensor, rows_from: int) -> torch.Tensor:
    """The model's causal attention [Hq, n - rows_from, n] of queries [Hq, n, D] rows >= rows_from over keys
    [Hkv, n, D]: its scale, logit soft-cap and sliding window on a sliding layer (glue.attention_form)."""
    from pyramidkv.models.glue import decoder

    n = q.shape[1]
    implementation = model.config._attn_implementation
    form = glue.attention_form(model.config, implementation)
    scale = q.shape[-1] ** -0.5 if form.scale is None else form.scale
    window = form.window(layer)
    logits = form.cap(q[:, rows_from:] @ k.repeat_interleave(q.shape[0] // k.shape[0], dim=0).transpose(1, 2) * scale)
    rows, cols = torch.arange(rows_from, n)[:, None], torch.arange(n)[None, :]
    allowed = (cols <= rows) & ((rows - cols < window) if window is not None else True)
    return torch.softmax(logits.masked_fill(~allowed, float("-inf")), dim=-1)


def measure(unit, candidate, queries: torch.Tensor, keys: torch.Tensor, probs: torch.Tensor,
            rows_from: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(recall [Hq], density [Hq]) of one candidate for every head of a layer; probs [Hq, n - rows_from, n]."""
    heads, n, _ = queries.shape
    masks = unit.head_masks([candidate] * heads, queries, keys)
    computed = torch.zeros(heads, dtype=torch.float64)
    step = max(1, (1 << 24) // (heads * n))
    for start in range(0, n, step):
        computed += masks.allowed(start, min(n, start + step)).sum(dim=(1, 2)).double()
    recall = torch.zeros(heads, dtype=torch.float64)
    for start in range(rows_from, n, step):
        stop = min(n, start + step)
        inside = probs[:, start - rows_from:stop - rows_from] * masks.allowed(start, stop)
        recall += inside.sum(dim=(1, 2)).double()
    return recall / (n - rows_from), computed / (n * (n + 1) / 2)


def choose(results: list[tuple[float, float]], selection: str, min_recall: float) -> int:
    """Index of the chosen candidate given its (recall, density) list."""
    if selection == "cheapest":
        good = [i for i, (recall, _) in enumerate(results) if recall >= min_recall]
        if good:
            return min(good, key=lambda i: (results[i][1], i))
    return max(range(len(results)), key=lambda i: (results[i][0], -i))   # the first of the highest recall


def official_entry(kind: str, vertical: int, slash: int) -> tuple[str, int, int]:
    if kind == "stream_llm":
        return "vertical_and_slash", vertical, slash
    if kind == "block_sparse":
        return "vertical_and_slash", 1000, 6096
    return kind, vertical, slash


# Below this many tokens the candidates' windows cover (nearly) every causal entry: the A-shape keeps 100 sinks
# and 800 recent tokens, so every head's recall is 1 and the table says nothing.
MIN_CONTEXT_LENGTH = 1024


def parse_args(argv=None):
    """The flags, every value checked before anything loads (one line, exit status 2)."""
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME
    from pyramidkv.models.patch import MODEL_GLUE

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--model_class", choices=list(MODEL_GLUE), default=None,
                        help="load the weights as this architecture (as the runners' --model_class)")
    parser.add_argument("--out", required=True, type=output_file)
    parser.add_argument("--context_length", type=int, default=4096,
                        help=f"calibration prompt tokens, at least {MIN_CONTEXT_LENGTH}")
    parser.add_argument("--selection", choices=("official", "cheapest"), default="official")
    parser.add_argument("--min_recall", type=float, default=0.95, help="with --selection cheapest: in [0, 1]")
    parser.add_argument("--rows_from", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.context_length < MIN_CONTEXT_LENGTH:
        parser.error(f"--context_length {args.context_length}: at least {MIN_CONTEXT_LENGTH} (shorter prompts fit "
                     f"inside the candidates' windows, so every pattern has recall 1)")
    if "min_recall" in parser.given and args.selection != "cheapest":
        parser.error(f"--min_recall {args.min_recall} only applies with --selection cheapest")
    if not 0.0 <= args.min_recall <= 1.0:
        parser.error(f"--min_recall {args.min_recall}: a recall is in [0, 1]")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: at least 1")
    if args.rows_from is not None and not 0 <= args.rows_from < args.context_length:
        parser.error(f"--rows_from {args.rows_from} must be in [0, --context_length {args.context_length})")
    return parser, args


def main(argv=None) -> None:
    parser, args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from pyramidkv.models.loading import check_model, load_model
    from pyramidkv.models.patch import MODEL_GLUE
    from pyramidkv.sparse_prefill.minference import MInference

    try:
        config = check_model(args.model_path, "sdpa", "cpu", None, args.model_class)[1]
    except (ValueError, ImportError, OSError) as e:
        parser.error(f"--model_path {args.model_path}: {e}")
    window = getattr(config, "max_position_embeddings", None)
    if window and args.context_length > window:
        parser.error(f"--context_length {args.context_length} is above the model's window ({window} tokens)")
    model, tokenizer = load_model(args.model_path, attn_implementation="sdpa", device="cpu", model_class=args.model_class)
    glue = MODEL_GLUE[model.config.model_type]
    ids = torch.tensor([calibration_ids(tokenizer, args.context_length)])
    n = ids.shape[1]
    rows_from = args.rows_from if args.rows_from is not None else min(2500, n // 2)
    if not 0 <= rows_from < n:
        parser.error(f"--rows_from {rows_from} must be in [0, {n})")
    started = time.time()
    queries, keys = layer_qk(model, ids)
    unit = MInference()
    table, chosen_density = [], []
    for layer, (q, k) in enumerate(zip(queries, keys)):
        q, k = q.float(), k.float()
        probs = dense_probs(glue, model, layer, q, k, rows_from)
        measured = [measure(unit, c, q, k, probs, rows_from) for c in CANDIDATES]
        row = {}
        for h in range(q.shape[0]):
            results = [(float(r[h]), float(d[h])) for r, d in measured]
            best = choose(results, args.selection, args.min_recall)
            kind, vertical, slash = CANDIDATES[best]
            if args.selection == "official":
                kind, vertical, slash = official_entry(kind, vertical, slash)
            row[str(h)] = [kind, vertical, slash, round(results[best][0], 6)]
            chosen_density.append(results[best][1])
        table.append(row)
        print(f"layer {layer}: " + ", ".join(f"{h}:{v[0][:6]}({v[1]},{v[2]}) r={v[3]:.3f}" for h, v in row.items()),
              flush=True)
    Path(args.out).write_text(json.dumps(table) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(table)} layers x {len(table[0])} heads, calibration {n} tokens, rows from "
          f"{rows_from}, selection {args.selection}, mean density of the chosen candidates (before any remapping) "
          f"{sum(chosen_density) / len(chosen_density):.3f}, {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
