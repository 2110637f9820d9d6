"""RULER runner: generate (or read) the samples, decode them under a compression method, score.

`run_ruler.py` at the repository root calls `main`. Per (task, context length):

1. samples: RULER-format JSONL from --data_file / --data_dir, else generated offline for the model's
   tokenizer and cached in `{cache_dir}/{model}/{task}_{length}.jsonl` (default cache_dir: {save_dir}/data);
2. greedy decoding (batches of --eval_batch_size, left padding, longest prompts first) under the method;
3. one prediction row per sample in `{save_dir}/{model}_{budget}/{method}/{task}_{length}.jsonl`
   ({"index", "pred", "outputs", "length", "prompt_tokens", "kv_bytes"}), flushed and fsynced as each batch
   ends, in the order the batches run (longest prompts first above batch size 1: not in index order);
   a rerun skips the indices already there (kill -9 safe); with --question_as_decode the part of each
   prompt after its haystack is fed as decode steps (the folder `{method}_question_as_decode`);
4. scores (string_match_all / string_match_part, x100) -> results.json + results.csv in the run folder.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.benchmarks.ruler.tasks import (
    DEFAULT_TASKS, OFFLINE_TASKS, QA_TASKS, TASKS, check_questions_per_context,
)
from pyramidkv.runner.protocol import (
    Benchmark, Question, Sample, SampleFile, achieved, block_fields, run_benchmark, write_results,
)
from pyramidkv.runner.protocol import build_parser as protocol_parser

DEFAULT_CONTEXT_LENGTH = 4096


@dataclass
class SampleSet:
    task: str
    length: int
    rows: list[dict]
    source: str                 # where the rows came from (cache or data file)

    @property
    def key(self) -> str:
        return f"{self.task}@{self.length}"

    questions_per_context: int = 1

    @property
    def file_name(self) -> str:
        several = f"_q{self.questions_per_context}" if self.questions_per_context > 1 else ""
        return f"{self.task}_{self.length}{several}.jsonl"


class Ruler(Benchmark):
    name = "ruler"
    prog = "run_ruler.py"
    description = "RULER (offline generator) under a KV-cache compression method: samples, predictions, scores."
    key = "index"
    batch_by_length = True   # score_run takes the rows in the samples' order
    input_paths = ("data_file", "data_dir", "squad_file", "hotpot_file")
    selection_args = {
        "tasks": "which task files run (one predictions file per task and length)",
        "context_lengths": "which task files run (same reason)",
        "num_samples": "how many samples run; each prediction row is keyed and checked on its own",
        "questions_per_context": "which task files run ({task}_{length}_q{K}.jsonl; rows keyed per question)",
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        r = parser.add_argument_group("RULER")
        r.add_argument("--tasks", nargs="+", default=None,
                       help=f"task names, or 'all' for the {len(OFFLINE_TASKS)} offline tasks: "
                            f"{', '.join(OFFLINE_TASKS)}; {' and '.join(QA_TASKS)} need --squad_file / --hotpot_file; "
                            f"also {', '.join(t for t in TASKS if t not in OFFLINE_TASKS and t not in QA_TASKS)} "
                            f"(SCBench's key-value retrieval, not in 'all'); "
                            f"when not given: {' '.join(DEFAULT_TASKS)}")
        r.add_argument("--context_lengths", nargs="+", type=int, default=None,
                       help=f"target lengths in tokens (prompt after the chat template + tokens to generate); when "
                            f"not given: {DEFAULT_CONTEXT_LENGTH}")
        r.add_argument("--num_samples", type=int, default=25, help="samples per task and length")
        r.add_argument("--seed", "--generator_seed", type=int, default=42,
                       help="the sample generator's seed (same seed -> identical samples); --generator_seed when the "
                            "method has a seed of its own (CaM's, GEAR's: --merge_seed, --quant_seed)")
        r.add_argument("--eval_batch_size", type=int, default=1, help="prompts decoded together (left padding)")
        r.add_argument("--questions_per_context", type=int, default=1, metavar="K",
                       help="K questions on each context (niah_multikey_*, niah_multivalue, niah_multiquery, vt, "
                            "kv_retrieval; docs/ruler.md): one row per question with its turn, each asked inside its "
                            "own prompt, or from the context compressed once with --shared_context; predictions go "
                            "to {task}_{length}_q{K}.jsonl")
        r.add_argument("--save_dir", default="results/ruler",
                       help="predictions go to {save_dir}/{model}_{budget}/{method}/{task}_{length}.jsonl")
        r.add_argument("--cache_dir", default=None, help="generated samples cache; when not given: {save_dir}/data")
        r.add_argument("--data_file", nargs="+", default=None,
                       help="RULER-format JSONL file(s) to run instead of generating ({task}_{length}.jsonl or "
                            "RULER's {length}/data/{task}/validation.jsonl)")
        r.add_argument("--data_dir", default=None,
                       help="folder of RULER-format JSONL: {task}_{length}.jsonl or {length}/data/{task}/validation.jsonl")
        r.add_argument("--squad_file", default=None, help="SQuAD v2.0 json (dev-v2.0.json) for qa_1")
        r.add_argument("--hotpot_file", default=None, help="HotpotQA dev json (hotpot_dev_distractor_v1.json) for qa_2")
        r.add_argument("--no_chat_template", action="store_true",
                       help="use the raw task prompt (otherwise the tokenizer's chat template around it)")
        r.add_argument("--system_prompt", default=None, metavar="TEXT",
                       help="a system turn before the task, in the chat template (when not given: none, as RULER's "
                            "model templates; the user turn alone, even where the template would add its own default "
                            "system prompt, e.g. SmolLM2's). Not with --no_chat_template")

    def check_arguments(self, args) -> None:
        if args.num_samples < 1:
            raise ValueError(f"--num_samples must be >= 1, got {args.num_samples}")
        if args.eval_batch_size < 1:
            raise ValueError(f"--eval_batch_size must be >= 1, got {args.eval_batch_size}")
        if args.data_file and args.data_dir:
            raise ValueError("give --data_file or --data_dir, not both")
        bad = [n for n in (args.context_lengths or []) if n < 1]
        if bad:
            raise ValueError(f"--context_lengths must be positive, got {bad}")
        if args.data_file and args.tasks is not None:
            raise ValueError("--tasks does not apply with --data_file: each file's task comes from its name or rows")
        unused = [flag for flag, value, task in (("--squad_file", args.squad_file, "qa_1"),
                                                  ("--hotpot_file", args.hotpot_file, "qa_2"))
                  if value and task not in (args.tasks or [])]
        if unused and not args.data_file:
            raise ValueError(f"{' and '.join(unused)} given but the matching task is not in --tasks")
        self.tasks = resolve_tasks(args.tasks if args.tasks is not None else DEFAULT_TASKS)
        # --questions_per_context: checked here, before any tokenizer loads, and nowhere else in this runner (the
        # generator checks each sample it builds, generate.fit_sample; a data file's rows, several_questions).
        k = args.questions_per_context
        if k < 1:
            raise ValueError(f"--questions_per_context must be >= 1, got {k}")
        for task in self.tasks if k > 1 and not args.data_file and not args.data_dir else ():
            check_questions_per_context(task, k)

    def prepare(self, args, tokenizer, config, out_dir):
        window = getattr(config, "max_position_embeddings", None) or sys.maxsize
        lengths = args.context_lengths or [DEFAULT_CONTEXT_LENGTH]
        self.sets = collect_sample_sets(args, self.tasks, lengths, tokenizer, self.model_label(args), window)
        files = []
        for s in self.sets:
            s.questions_per_context = args.questions_per_context
            samples = []
            for row in s.rows:
                label = f"{s.source}: sample {row['index']}"
                if args.questions_per_context > 1:
                    samples.append(several_questions(tokenizer, row, label, args.questions_per_context))
                    continue
                prompt, question_start = tokenizer(row["input"], add_special_tokens=False).input_ids, None
                if args.question_as_decode or args.shared_context:
                    prompt, question_start = split_at_question(
                        tokenizer, row, label, "--shared_context" if args.shared_context else "--question_as_decode")
                samples.append(Sample(row["index"], prompt, row["max_new_tokens"],
                                      {"outputs": row["outputs"], "length": row["length"]}, label,
                                      question_start=question_start, reference=", ".join(row["outputs"])))
            files.append(SampleFile(s.key, s.file_name, samples, s.source))
        return files

    def check_resume(self, path, sample_file) -> None:
        check_resume(path, next(s for s in self.sets if s.key == sample_file.name))

    def meta_extra(self, args, files) -> dict:
        return {"tasks": [s.key for s in self.sets], "data": {s.key: s.source for s in self.sets}}

    def prediction_row(self, sample, output) -> dict:
        return {"index": sample.key, "pred": output.text, **sample.row, "prompt_tokens": output.prompt_tokens,
                "kv_bytes": output.kv_bytes_per_prompt, **achieved(output), **block_fields(output)}

    def score(self, args, out_dir, files, method, model) -> dict:
        return score_run(out_dir, self.sets, model, method)

    def format(self, result: dict) -> str:
        return format_scores(result)


def several_questions(tokenizer, row: dict, label: str, k: int) -> Sample:
    """A row with K questions as one sample: the context (the prompt before "question_start") and per question
    its part after the context, its follow-up turn and its references. Context and questions are tokenized apart,
    the same tokens whether the questions are asked from a shared context or each inside its own prompt."""
    questions = row.get("questions") or []
    if row.get("question_start") is None or len(questions) < k:
        raise ValueError(f"--questions_per_context {k}: {label} holds {len(questions)} question(s) and "
                         f"{'a' if row.get('question_start') is not None else 'no'} \"question_start\"; it needs "
                         f"both (rows this runner generates with --questions_per_context {k})")
    asked = [Question.of(tokenizer, q, {"outputs": q["outputs"]}) for q in questions[:k]]
    context = tokenizer(row["input"][:row["question_start"]], add_special_tokens=False).input_ids
    return Sample(row["index"], context, row["max_new_tokens"],
                  {"length": row["length"]}, label, questions=asked)


def split_at_question(tokenizer, row: dict, label: str, flag: str = "--question_as_decode") -> tuple[list[int], int]:
    """(the prompt's token ids, the index of its question part's first token): the part from the row's
    "question_start" (the character offset where the haystack ends, generate.context_end) on."""
    from pyramidkv.generation import split_prompt

    if row.get("question_start") is None:
        raise ValueError(f"{flag}: {label} records no \"question_start\" (where its question part "
                         f"begins; RULER's own files do not), so its question cannot be split off; let this "
                         f"runner generate the samples (no --data_file / --data_dir)")
    context, question = split_prompt(tokenizer, row["input"], row["question_start"])
    return context + question, len(context)


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
            several = {"questions_per_context": args.questions_per_context} if args.questions_per_context > 1 else {}
            rows = load_or_generate(task, length, args.num_samples, formatter, cache_dir, model_name, args.seed,
                                    args.squad_file, args.hotpot_file, **several)
            name = f"{task}_{length}" + (f"_q{args.questions_per_context}" if several else "")
            sets.append(SampleSet(task, length, rows, str(cache_dir / model_name / f"{name}.jsonl")))
    return sets


def expected_rows(sample_set: SampleSet) -> dict:
    """key -> the references its prediction row must carry: by "index", or by "qid" (one row per question) where
    the set asks several questions per context."""
    from pyramidkv.runner.shared import qid

    k = sample_set.questions_per_context
    if k == 1:
        return {row["index"]: row["outputs"] for row in sample_set.rows}
    return {qid(row["index"], turn): q["outputs"] for row in sample_set.rows
            for turn, q in enumerate((row.get("questions") or [])[:k], start=1)}


def row_key(sample_set: SampleSet) -> str:
    return "index" if sample_set.questions_per_context == 1 else "qid"


def check_resume(path: Path, sample_set: SampleSet) -> None:
    """Predictions already in `path` must come from the same samples (same outputs at the same index, or question),
    each once."""
    from pyramidkv.runner.results import read_unique_rows

    if not path.is_file():
        return
    expected, key = expected_rows(sample_set), row_key(sample_set)
    # A torn last line (killed mid-write) is skipped here; ResultsWriter cuts it off.
    for done in read_unique_rows(path, key, skip_torn_last_line=True):
        outputs = expected.get(done[key])
        if outputs is not None and done.get("outputs") != outputs:
            raise ValueError(f"{path} holds predictions made from other samples ({key} {done[key]}: "
                             f"references differ, e.g. another --seed or tokenizer); delete it or use another "
                             f"--save_dir")


def score_run(out_dir: Path, sets: Sequence[SampleSet], model_name: str, method) -> dict:
    """Scores of the finished sample sets -> results.json and results.csv (both written atomically)."""
    from pyramidkv.benchmarks.ruler.scoring import score_task
    from pyramidkv.methods import method_spec
    from pyramidkv.runner.results import read_unique_rows

    scores, counts, shares, turn_scores = {}, {}, {}, {}
    for s in sets:
        path, key = out_dir / s.file_name, row_key(s)
        done = {r[key]: r for r in read_unique_rows(path, key)} if path.is_file() else {}
        # In the samples' order, whatever order the batches wrote them in: the sum's rounding is the same.
        rows = [done[k] for k in expected_rows(s) if k in done]
        if not rows:
            continue
        scores[s.key] = score_task(s.task, [r["pred"] for r in rows], [r["outputs"] for r in rows])
        counts[s.key] = len(rows)
        if s.questions_per_context > 1:   # the first question against the follow-ups
            first = [r for r in rows if r["turn"] == 1]
            later = [r for r in rows if r["turn"] > 1]
            turn_scores[s.key] = {
                "1": score_task(s.task, [r["pred"] for r in first], [r["outputs"] for r in first]) if first else None,
                f"2-{s.questions_per_context}": score_task(s.task, [r["pred"] for r in later],
                                                           [r["outputs"] for r in later]) if later else None}
        if all("kept_share" in r for r in rows):   # a budget that is an outcome: the mean achieved share per task
            shares[s.key] = round(math.fsum(r["kept_share"] for r in rows) / len(rows), 6)
    average = round(math.fsum(scores.values()) / len(scores), 2) if scores else None
    result = {"benchmark": "ruler", "model": model_name, "method": method.label(), "method_spec": method_spec(method),
              "budget": method.sizing.recorded(method), "scores": scores, "average": average, "num_samples": counts,
              **({"kept_share": shares} if shares else {}), **({"turn_scores": turn_scores} if turn_scores else {})}
    header = ["task", "length", "score", "num_samples"] + (["score_turn_1", "score_later_turns"] if turn_scores else [])
    table = [[s.task, s.length, scores[s.key], counts[s.key],
              *(list(turn_scores[s.key].values()) if turn_scores else [])] for s in sets if s.key in scores]
    table.append(["average", "", "" if average is None else average, sum(counts.values())])
    write_results(out_dir, result, header, table)
    return result


def format_scores(result: dict) -> str:
    budget = "full" if result["budget"] is None else result["budget"]
    lines = [f"RULER  {result['model']} / {result['method']} / budget {budget}"]
    for key, score in result["scores"].items():
        share = result.get("kept_share", {}).get(key)
        kept = "" if share is None else f"   kept {share:.3f}"
        turns = result.get("turn_scores", {}).get(key)
        by_turn = "" if turns is None else "   " + "  ".join(
            f"turn {t}: {'-' if v is None else f'{v:.2f}'}" for t, v in turns.items())
        lines.append(f"  {key:<24} {score:>7.2f}   n={result['num_samples'][key]}{kept}{by_turn}")
    if result["average"] is not None:
        lines.append(f"  {'average':<24} {result['average']:>7.2f}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_benchmark(Ruler(), argv)


def build_parser() -> argparse.ArgumentParser:
    return protocol_parser(Ruler())
