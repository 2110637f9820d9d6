"""RULER runner: generate (or read) the samples, decode them under a compression method, score.

`run_ruler.py` at the repository root calls `main`. Per (task, context length):

1. samples: RULER-format JSONL from --data_file / --data_dir, else generated offline for the model's
   tokenizer and cached in `{cache_dir}/{model}/{task}_{length}.jsonl` (default cache_dir: {save_dir}/data);
2. greedy decoding (batches of --eval_batch_size, left padding) under the method;
3. one prediction row per sample in `{save_dir}/{model}_{budget}/{method}/{task}_{length}.jsonl`
   ({"index", "pred", "outputs", "length", "prompt_tokens", "kv_bytes"}), flushed and fsynced as written;
   a rerun skips the indices already there (kill -9 safe);
4. scores (string_match_all / string_match_part, x100) -> results.json + results.csv in the run folder.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.benchmarks.ruler.tasks import DEFAULT_TASKS, OFFLINE_TASKS, QA_TASKS, TASKS


@dataclass
class SampleSet:
    task: str
    length: int
    rows: list[dict]
    source: str                 # where the rows came from (cache or data file)

    @property
    def key(self) -> str:
        return f"{self.task}@{self.length}"

    @property
    def file_name(self) -> str:
        return f"{self.task}_{self.length}.jsonl"


def build_parser() -> argparse.ArgumentParser:
    from pyramidkv.runner.cli import add_model_and_method_args

    parser = argparse.ArgumentParser(
        prog="run_ruler.py",
        description="RULER (offline generator) under a KV-cache compression method: samples, predictions, scores.",
    )
    add_model_and_method_args(parser)
    r = parser.add_argument_group("RULER")
    r.add_argument("--tasks", nargs="+", default=None,
                   help=f"default: {' '.join(DEFAULT_TASKS)}; task names, or 'all' for the "
                        f"{len(OFFLINE_TASKS)} offline tasks: {', '.join(OFFLINE_TASKS)}; "
                        f"{' and '.join(QA_TASKS)} need --squad_file / --hotpot_file")
    r.add_argument("--context_lengths", nargs="+", type=int, default=None,
                   help="target lengths in tokens (prompt after the chat template + tokens to generate); default 4096")
    r.add_argument("--num_samples", type=int, default=25, help="samples per task and length")
    r.add_argument("--seed", type=int, default=42, help="generator seed (same seed -> identical samples)")
    r.add_argument("--eval_batch_size", type=int, default=1, help="prompts decoded together (left padding)")
    r.add_argument("--save_dir", default="results/ruler",
                   help="predictions go to {save_dir}/{model}_{budget}/{method}/{task}_{length}.jsonl")
    r.add_argument("--cache_dir", default=None, help="generated samples cache (default {save_dir}/data)")
    r.add_argument("--data_file", nargs="+", default=None,
                   help="RULER-format JSONL file(s) to run instead of generating ({task}_{length}.jsonl or "
                        "RULER's {length}/data/{task}/validation.jsonl)")
    r.add_argument("--data_dir", default=None,
                   help="folder of RULER-format JSONL: {task}_{length}.jsonl or {length}/data/{task}/validation.jsonl")
    r.add_argument("--squad_file", default=None, help="SQuAD v2.0 json (dev-v2.0.json) for qa_1")
    r.add_argument("--hotpot_file", default=None, help="HotpotQA dev json (hotpot_dev_distractor_v1.json) for qa_2")
    r.add_argument("--no_chat_template", action="store_true",
                   help="use the raw task prompt (default: the tokenizer's chat template around it)")
    r.add_argument("--system_prompt", default=None, metavar="TEXT",
                   help="a system turn before the task, in the chat template (default: none, as RULER's model "
                        "templates; the user turn alone, even where the template would add its own default "
                        "system prompt, e.g. SmolLM2's). Not with --no_chat_template")
    return parser


def resolve_tasks(names: Sequence[str]) -> list[str]:
    tasks: list[str] = []
    for name in names:
        expanded = list(OFFLINE_TASKS) if name.lower() == "all" else [name]
        for task in expanded:
            if task not in TASKS:
                raise ValueError(f"unknown RULER task {task!r}; allowed: {', '.join(TASKS)}, or 'all' "
                                 f"(= {', '.join(OFFLINE_TASKS)})")
            if task not in tasks:
                tasks.append(task)
    return tasks


def collect_sample_sets(args, tasks: list[str], lengths: list[int], tokenizer, model_name: str,
                        window: int) -> list[SampleSet]:
    from pyramidkv.benchmarks.ruler.generate import (
        PromptFormatter, find_in_data_dir, infer_task_length, load_or_generate, read_data_file,
    )

    def check_length(task: str, length: int, where: str) -> None:
        if length > window:
            raise ValueError(f"context length {length} ({task}, {where}) is above the model's window: "
                             f"{args.model_path} has max_position_embeddings = {window}")

    sets: list[SampleSet] = []
    if args.data_file:
        for path in args.data_file:
            path = Path(path)
            if not path.is_file():
                raise FileNotFoundError(f"--data_file {path}: no such file")
            task, length = infer_task_length(path, args.context_lengths)
            check_length(task, length, str(path))
            rows = read_data_file(path, task)[:args.num_samples]
            sets.append(SampleSet(task, length, rows, str(path)))
        return sets
    if args.data_dir:
        for task in tasks:
            for length in lengths:
                check_length(task, length, "--context_lengths")
                path = find_in_data_dir(Path(args.data_dir), task, length, single_length=len(lengths) == 1)
                sets.append(SampleSet(task, length, read_data_file(path, task)[:args.num_samples], str(path)))
        return sets
    for task in tasks:
        for length in lengths:
            check_length(task, length, "--context_lengths")
    formatter = PromptFormatter(tokenizer, use_chat_template=not args.no_chat_template,
                                system_prompt=args.system_prompt)
    cache_dir = Path(args.cache_dir) if args.cache_dir else Path(args.save_dir) / "data"
    for task in tasks:
        for length in lengths:
            rows = load_or_generate(task, length, args.num_samples, formatter, cache_dir, model_name, args.seed,
                                    args.squad_file, args.hotpot_file)
            sets.append(SampleSet(task, length, rows, str(cache_dir / model_name / f"{task}_{length}.jsonl")))
    return sets


def check_resume(path: Path, sample_set: SampleSet) -> None:
    """Predictions already in `path` must come from the same samples (same outputs at the same index),
    each index once."""
    from pyramidkv.runner.results import read_unique_rows

    if not path.is_file():
        return
    by_index = {row["index"]: row for row in sample_set.rows}
    # A torn last line (killed mid-write) is skipped here; ResultsWriter cuts it off.
    for done in read_unique_rows(path, "index", skip_torn_last_line=True):
        row = by_index.get(done["index"])
        if row is not None and done.get("outputs") != row["outputs"]:
            raise ValueError(f"{path} holds predictions made from other samples (index {done['index']}: "
                             f"references differ, e.g. another --seed or tokenizer); delete it or use another "
                             f"--save_dir")


def score_run(out_dir: Path, sets: Sequence[SampleSet], model_name: str, method) -> dict:
    """Scores of the finished sample sets -> results.json and results.csv (both written atomically)."""
    import csv
    import io

    from pyramidkv.benchmarks.ruler.scoring import score_task
    from pyramidkv.runner.cli import budget_value
    from pyramidkv.runner.results import atomic_write_json, atomic_write_text, read_unique_rows

    scores, counts = {}, {}
    for s in sets:
        path = out_dir / s.file_name
        wanted = {row["index"] for row in s.rows}
        rows = [r for r in read_unique_rows(path, "index") if r["index"] in wanted] if path.is_file() else []
        if not rows:
            continue
        scores[s.key] = score_task(s.task, [r["pred"] for r in rows], [r["outputs"] for r in rows])
        counts[s.key] = len(rows)
    average = round(math.fsum(scores.values()) / len(scores), 2) if scores else None
    result = {"benchmark": "ruler", "model": model_name, "method": method.name, "budget": budget_value(method),
              "scores": scores, "average": average, "num_samples": counts}
    atomic_write_json(out_dir / "results.json", result)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(["task", "length", "score", "num_samples"])
    for s in sets:
        if s.key in scores:
            writer.writerow([s.task, s.length, scores[s.key], counts[s.key]])
    writer.writerow(["average", "", "" if average is None else average, sum(counts.values())])
    atomic_write_text(out_dir / "results.csv", text.getvalue())
    return result


def format_scores(result: dict) -> str:
    budget = "full" if result["budget"] is None else result["budget"]
    lines = [f"RULER  {result['model']} / {result['method']} / budget {budget}"]
    for key, score in result["scores"].items():
        lines.append(f"  {key:<24} {score:>7.2f}   n={result['num_samples'][key]}")
    if result["average"] is not None:
        lines.append(f"  {'average':<24} {result['average']:>7.2f}")
    return "\n".join(lines)


def _batches(rows: list[dict], size: int) -> list[list[dict]]:
    """Batches of at most `size` rows, each with one max_new_tokens (rows from other files may differ)."""
    groups: dict[int, list[dict]] = {}
    for row in rows:
        groups.setdefault(row["max_new_tokens"], []).append(row)
    return [group[i:i + size] for group in groups.values() for i in range(0, len(group), size)]


def main(argv: Optional[Sequence[str]] = None) -> int:
    from pyramidkv.runner.cli import (
        INPUT_ERRORS, check_model_args, check_run_args, fail, method_from_args, model_label,
        run_dir, run_fingerprint,
    )
    from pyramidkv.runner.run_folder import check_writable, exit_on_disk_full, open_run_folder

    parser = build_parser()
    args = parser.parse_args(argv)
    check_run_args(parser, args)
    if args.num_samples < 1:
        parser.error(f"--num_samples must be >= 1, got {args.num_samples}")
    if args.eval_batch_size < 1:
        parser.error(f"--eval_batch_size must be >= 1, got {args.eval_batch_size}")
    if args.data_file and args.data_dir:
        parser.error("give --data_file or --data_dir, not both")
    lengths = args.context_lengths or [4096]
    bad = [n for n in lengths if n < 1]
    if bad:
        parser.error(f"--context_lengths must be positive, got {bad}")
    if args.data_file and args.tasks is not None:
        parser.error("--tasks does not apply with --data_file: each file's task comes from its name or rows")
    unused = [flag for flag, value, task in (("--squad_file", args.squad_file, "qa_1"),
                                              ("--hotpot_file", args.hotpot_file, "qa_2"))
              if value and task not in (args.tasks or [])]
    if unused and not args.data_file:
        parser.error(f"{' and '.join(unused)} given but the matching task is not in --tasks")
    try:
        tasks = resolve_tasks(args.tasks if args.tasks is not None else DEFAULT_TASKS)
        method = method_from_args(args)
    except (ValueError, TypeError) as e:
        parser.error(str(e))

    # Everything that can fail (model, device, paths, window, data, run folder) does so before the model loads.
    try:
        from transformers import AutoTokenizer

        out_dir = run_dir(args.save_dir, args.model_path, method)
        check_writable(out_dir)
        model_check = check_model_args(args, method)
        path, config = model_check[0], model_check[1]
        window = getattr(config, "max_position_embeddings", None) or sys.maxsize
        tokenizer = AutoTokenizer.from_pretrained(path)
        model_name = model_label(args.model_path)
        sets = collect_sample_sets(args, tasks, lengths, tokenizer, model_name, window)
        encoded = {}
        for s in sets:
            for row in s.rows:
                ids = tokenizer(row["input"], add_special_tokens=False).input_ids
                if len(ids) + row["max_new_tokens"] > window:
                    raise ValueError(f"{s.source}: sample {row['index']} needs {len(ids)} prompt + "
                                     f"{row['max_new_tokens']} new tokens, above the model's window: "
                                     f"{args.model_path} has max_position_embeddings = {window}")
                encoded[(s.key, row["index"])] = ids
        for s in sets:
            check_resume(out_dir / s.file_name, s)
        fingerprint = run_fingerprint(args, method, model_check)
        lock = open_run_folder(out_dir, fingerprint, args.overwrite)
    except INPUT_ERRORS as e:
        fail(parser, e)

    from pyramidkv.runner.results import ResultsWriter, write_run_meta

    writers = {}
    try:
        with exit_on_disk_full(out_dir):
            write_run_meta(out_dir, vars(args), method, extra={
                "benchmark": "ruler", "tasks": [s.key for s in sets],
                "data": {s.key: s.source for s in sets}, "resolved_model_path": str(path),
            }, fingerprint=fingerprint)
            print(f"results -> {out_dir}")
            writers = {s.key: ResultsWriter(out_dir / s.file_name, key="index") for s in sets}
            _decode_pending(args, method, sets, encoded, writers)
        try:
            result = score_run(out_dir, sets, model_label(args.model_path), method)
        except ValueError as e:
            fail(parser, e)
    finally:
        for writer in writers.values():
            try:
                writer.close()
            except OSError:
                pass
        lock.release()
    print(format_scores(result))
    return 0


def _decode_pending(args, method, sets: Sequence[SampleSet], encoded: dict, writers: dict) -> None:
    """Decode every sample not yet in its predictions file, appending one row per sample (the model
    loads only when a sample is pending)."""
    from tqdm import tqdm

    from pyramidkv.runner.cli import apply_num_threads

    pending = {s.key: [r for r in s.rows if r["index"] not in writers[s.key].done] for s in sets}
    total = sum(len(s.rows) for s in sets)
    todo = sum(len(p) for p in pending.values())
    if not todo:
        print(f"all {total} sample(s) already done; scoring only")
        return
    from pyramidkv.models.loading import load_model
    from pyramidkv.generation import generate

    apply_num_threads(args)
    model, tokenizer = load_model(args.model_path, attn_implementation=args.attn_implementation,
                                  device=args.device, dtype=args.dtype, model_class=args.model_class)
    started = time.perf_counter()
    with tqdm(total=total, initial=total - todo, unit="sample", dynamic_ncols=True, desc="RULER") as bar:
        for s in sets:
            bar.set_postfix_str(s.key)
            for batch in _batches(pending[s.key], args.eval_batch_size):
                outputs = generate(model, tokenizer, [encoded[(s.key, r["index"])] for r in batch], method,
                                   max_new_tokens=batch[0]["max_new_tokens"])
                for row, out in zip(batch, outputs):
                    writers[s.key].append({
                        "index": row["index"], "pred": out.text, "outputs": row["outputs"],
                        "length": row["length"], "prompt_tokens": out.prompt_tokens,
                        "kv_bytes": out.kv_bytes_per_prompt,
                    })
                bar.update(len(batch))
    elapsed = time.perf_counter() - started
    print(f"{todo} sample(s) in {elapsed:.1f} s ({60 * todo / elapsed:.2f} samples/min, "
          f"batch size {args.eval_batch_size}); {total - todo} already done")
