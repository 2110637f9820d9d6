"""Compute HeadKV's per-head importance table for any supported model (docs/head_scores.md).

    python scripts/head_scores.py --model_path M [--model_class C] [--out FILE] [--kind reasoning|retrieval|both]
        [--num_probes 24] [--context_lengths 500 1000 2000] [--seed 0] [--attn_implementation eager]

Output (HeadKV's layout, read by pyramidkv.allocation.head_tables.load_head_scores and by
HeadKV's own loader): line 1 = {"layer-head": [score per answered probe]}, line 2 =
{"run_meta": {...}} (arguments, model, time, every probe's answer).
File names: with one kind, --out FILE is written as given (default
"{model}_{kind}.json", model = the last component of the model path, lowercased);
with --kind both, "{stem}_retrieval{suffix}" and "{stem}_reasoning{suffix}" next to FILE.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import platform
import sys
import time
from pathlib import Path

from pyramidkv.runner.arguments import ArgumentParser


KINDS = ("reasoning", "retrieval")


def output_paths(out: str | None, kind: str, model_path: str) -> dict[str, Path]:
    """kind -> output file (see the module docstring for the naming)."""
    kinds = KINDS if kind == "both" else (kind,)
    if out is None:
        model = Path(str(model_path).rstrip("/\\")).name.lower()
        return {k: Path(f"{model}_{k}.json") for k in kinds}
    out_path = Path(out)
    if kind != "both":
        return {kind: out_path}
    return {k: out_path.with_name(f"{out_path.stem}_{k}{out_path.suffix or '.json'}") for k in kinds}


def parse_args(argv=None) -> argparse.Namespace:
    from pyramidkv.models.default_model import DEFAULT_MODEL_NAME
    from pyramidkv.models.patch import MODEL_GLUE

    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_path", default=DEFAULT_MODEL_NAME)
    parser.add_argument("--model_class", choices=list(MODEL_GLUE), default=None,
                        help="load the weights as this architecture (as the runners' --model_class)")
    parser.add_argument("--out", default=None, help="output file (see the naming rule above)")
    parser.add_argument("--kind", choices=(*KINDS, "both"), default="reasoning",
                        help="reasoning: HeadKV's retrieval-reasoning score (its default); retrieval: Wu et al.'s")
    parser.add_argument("--num_probes", type=int, default=24)
    parser.add_argument("--context_lengths", type=int, nargs="+", default=[500, 1000, 2000],
                        help="probe context lengths in tokens (NeedleHaystack's, buffer 200 included)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attn_implementation", choices=("eager",), default="eager",
                        help="eager only: the scores read the attention weights")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--haystack_dir", default=None, help="folder of .txt files (default: the Paul Graham essays)")
    parser.add_argument("--keep_unanswered", action="store_true",
                        help="also score probes the model answered wrongly (the public code drops them)")
    args = parser.parse_args(argv)
    if args.num_probes < 1:
        parser.error(f"--num_probes must be >= 1, got {args.num_probes}")
    if min(args.context_lengths) < 1:
        parser.error(f"--context_lengths must be positive token counts, got {args.context_lengths}")
    return args


def main(argv=None) -> dict[str, Path]:
    args = parse_args(argv)
    from tqdm import tqdm

    from pyramidkv.benchmarks.head_scoring import as_headkv_dict, compute_head_scores
    from pyramidkv.allocation.head_tables import load_head_scores
    from pyramidkv.benchmarks.needle import NeedleHaystack, load_haystack_text
    from pyramidkv.models.loading import check_model, load_model
    from pyramidkv.runner.results import _git_commit, _versions, atomic_write_text

    paths = output_paths(args.out, args.kind, args.model_path)
    # Every check before the weights load: model, device, dtype, haystack, probe lengths.
    try:
        from transformers import AutoTokenizer

        path, config, _, _ = check_model(args.model_path, args.attn_implementation, args.device, args.dtype,
                                         args.model_class)
        # ~8 characters per token is ample; NeedleHaystack repeats the text when it is short.
        haystack = load_haystack_text(args.haystack_dir)[: 8 * max(args.context_lengths) + 1000]
        NeedleHaystack(AutoTokenizer.from_pretrained(path), haystack).check_context_lengths(
            min(args.context_lengths), max(args.context_lengths), window=config.max_position_embeddings,
            max_new_tokens=32, flags=("--context_lengths (shortest)", "--context_lengths (longest)"))
    except (ValueError, OSError, ImportError) as e:
        raise SystemExit(f"head_scores.py: error: {e}") from None
    model, tokenizer = load_model(args.model_path, attn_implementation=args.attn_implementation,
                                  device=args.device, dtype=args.dtype, model_class=args.model_class)

    for kind, path in paths.items():
        started = time.time()
        with tqdm(total=args.num_probes, desc=f"{kind} probes", unit="probe", dynamic_ncols=True) as bar:
            def advance(result):
                bar.update(1)
                bar.set_postfix(answered=f"{result.answered}")
            results = compute_head_scores(model, tokenizer, haystack, kind, args.num_probes, args.context_lengths,
                                          seed=args.seed, on_probe=advance)
        kept = results if args.keep_unanswered else [r for r in results if r.answered]
        if not kept:
            raise SystemExit(f"error: the model answered none of the {len(results)} {kind} probes, so no head "
                             f"scores; use --keep_unanswered, more --num_probes or shorter --context_lengths")
        run_meta = {
            "arguments": vars(args), "kind": kind, "model": args.model_path,
            "num_layers": model.config.num_hidden_layers, "num_query_heads": model.config.num_attention_heads,
            "time": _dt.datetime.now(_dt.timezone.utc).isoformat(), "seconds": round(time.time() - started, 1),
            "command": [sys.executable, *sys.argv], "git_commit": _git_commit(), "python": platform.python_version(),
            "versions": _versions(["torch", "transformers"]),
            "probes_scored": len(kept), "probes_run": len(results),
            "probes": [{"context_length": r.context_length, "depth_percent": r.depth_percent, "needle": r.needle,
                        "answer": r.answer, "response": r.response, "answered": r.answered,
                        "scored": args.keep_unanswered or r.answered} for r in results],
        }
        # Line 1 must hold the whole dict (HeadKV reads it with json.loads(file.readline())).
        text = json.dumps(as_headkv_dict(kept)) + "\n" + json.dumps({"run_meta": run_meta}, default=str) + "\n"
        atomic_write_text(path, text)
        table = load_head_scores(path)
        top = sorted(((table[l, h], l, h) for l in range(table.shape[0]) for h in range(table.shape[1])),
                     reverse=True)[:5]
        print(f"{kind}: {len(kept)}/{len(results)} probes scored, {time.time() - started:.0f} s -> {path}; "
              f"top heads (layer-head): {', '.join(f'{l}-{h} ({s:.3f})' for s, l, h in top)}")
    return paths


if __name__ == "__main__":
    main()
