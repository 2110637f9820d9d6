"""Long generations under a KV-cache compression method (docs/reasoning.md); `run_reasoning.py` at the repository
root calls `main`.

Writes {save_dir}/{model}_{budget}/{method}/:
    {task}.jsonl   one row per problem, appended and flushed as it finishes (resumable after kill -9): the
                   answer and its grade, the trace's token ids, its length, KL to fullkv along fullkv's trace,
                   the step it departs from fullkv's, peak and mean K/V bytes, decode tokens/s
    results.json   per task means (+ results.csv), run_meta.json the full configuration

The rule for fullkv's trace: run `--method fullkv` first with the same flags into the same --save_dir; a method's
run reads fullkv's trace of each problem from there and refuses, before the weights load, a problem it lacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.benchmarks.reasoning import tasks as T
from pyramidkv.benchmarks.reasoning.answers import chain_steps, gsm8k_answer, last_boxed, math_equal
from pyramidkv.benchmarks.reasoning.compare import departure_step, kl_along, trace_digest
from pyramidkv.components import setting_help
from pyramidkv.runner.protocol import Benchmark, Sample, SampleFile, run_benchmark, write_results
from pyramidkv.runner.protocol import build_parser as protocol_parser

SCORES = ("accuracy", "step_accuracy", "new_tokens", "kl_vs_fullkv", "departure_step", "departed", "kv_bytes_peak",
          "kv_bytes_mean", "decode_tokens_per_s")


@dataclass
class ReasoningSettings:
    """The runner's own settings (flags of the same names).

    tasks: tasks to run: chain (generated: an arithmetic chain, its value known after every step), gsm8k (GSM8K
        test, first 200 rows shipped), math500 (MATH-500, all 500 shipped).
    num_samples: problems per task (the first ones).
    max_new_tokens: the most tokens a trace may generate.
    chain_steps: steps of each generated chain.
    chain_seed: seed of the generated chains (same seed: same problems).
    do_sample: sample each token (inverse CDF on a seeded stream, the same for every method) instead of greedy.
    temperature: with do_sample: the logits are divided by it.
    top_p: with do_sample: nucleus sampling's probability mass (1: all tokens).
    sample_seed: with do_sample: seeds each problem's stream (with its task and index).
    data_file: a JSONL of GSM8K (question, answer with ####) or MATH (problem, answer) rows instead of the shipped
        one; one task only.
    eval_batch_size: problems per forward: each trace runs alone, so 1.
    save_dir: predictions go to {save_dir}/{model}_{budget}/{method}/{task}.jsonl; fullkv's run is read from the
        same save_dir.
    """

    tasks: list = field(default_factory=lambda: list(T.DEFAULT_TASKS))
    num_samples: int = 4
    max_new_tokens: int = 256
    chain_steps: int = 16
    chain_seed: int = 0
    do_sample: bool = False
    temperature: float = 0.6
    top_p: float = 0.95
    sample_seed: int = 0
    data_file: Optional[str] = None
    eval_batch_size: int = 1
    save_dir: str = "results/reasoning"


ONLY_WITH_SAMPLING = ("temperature", "top_p", "sample_seed")


def _mean(values) -> Optional[float]:
    values = [float(v) for v in values if v is not None]
    return math.fsum(values) / len(values) if values else None


class Reasoning(Benchmark):
    name = "reasoning"
    prog = "run_reasoning.py"
    description = __doc__
    key = "index"
    input_paths = ("data_file",)
    selection_args = {
        "tasks": "which task files run (one predictions file per task)",
        "num_samples": "how many problems run; each row is keyed and checked on its own",
    }

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("reasoning")
        helps = setting_help(ReasoningSettings)
        for f in fields(ReasoningSettings):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            text = helps[f.name] + ("" if default is None or default is False else f" (default: {default})")
            if f.type == "bool":
                g.add_argument(f"--{f.name}", action="store_true", help=text)
            elif f.name == "tasks":
                g.add_argument("--tasks", nargs="+", choices=T.TASKS, default=default, help=text)
            else:
                kind = {"int": int, "float": float}.get(f.type, str)
                g.add_argument(f"--{f.name}", type=kind, default=default, help=text)

    def check_arguments(self, args) -> None:
        for name in ("num_samples", "max_new_tokens", "chain_steps", "eval_batch_size"):
            if getattr(args, name) < 1:
                raise ValueError(f"--{name} must be an integer >= 1, got {getattr(args, name)}")
        if args.eval_batch_size != 1:
            raise ValueError(f"--eval_batch_size must be 1 (each trace decodes alone), got {args.eval_batch_size}")
        for flag in ("shared_context", "question_as_decode", "kl_vs_fullkv"):
            if getattr(args, flag):
                raise ValueError(f"--{flag} does not apply: each trace is one whole prompt, already compared with "
                                 f"fullkv's along fullkv's trace")
        if not args.do_sample:
            given = [f"--{n}" for n in ONLY_WITH_SAMPLING if n in self.given]
            if given:
                raise ValueError(f"{', '.join(given)} only with --do_sample (greedy otherwise)")
        self.sampling = None
        if args.do_sample:
            from pyramidkv.generation.trace import Sampling

            self.sampling = Sampling(args.temperature, args.top_p, args.sample_seed)
            try:
                self.sampling.validate()
            except ValueError as e:
                raise ValueError(f"--{e}") from None
        self.tasks = list(dict.fromkeys(args.tasks))
        if args.data_file and (len(self.tasks) != 1 or self.tasks[0] == "chain"):
            raise ValueError(f"--data_file replaces one dataset's rows: give --tasks gsm8k or --tasks math500 alone, "
                             f"got --tasks {' '.join(self.tasks)}")

    def prepare(self, args, tokenizer, config, out_dir):
        from pyramidkv.benchmarks.prompting import chat_frame

        frame = chat_frame(tokenizer)
        self.facts = {k: str(getattr(args, k)) for k in ("model_path", "dtype", "attn_implementation", "model_class")}
        files = []
        for task in self.tasks:
            samples = []
            for problem in T.problems(task, args.num_samples, args.chain_steps, args.chain_seed, args.data_file):
                ids = tokenizer(T.prompt_text(task, problem, frame), add_special_tokens=False).input_ids
                sampling = self._sampling_of(task, problem.index)
                row = {"task": task, "reference": problem.answer, "steps": problem.steps,
                       "trace_digest": trace_digest(ids, args.max_new_tokens, sampling, self.facts)}
                samples.append(Sample(problem.index, ids, args.max_new_tokens, row, f"{task} problem {problem.index}"))
            files.append(SampleFile(task, f"{task}.jsonl", samples, task))
        return files

    def _sampling_of(self, task: str, index: int):
        if self.sampling is None:
            return None
        return dataclasses.replace(self.sampling, seed=self.sampling.seed * 2**32 + zlib.crc32(f"{task}:{index}".encode()))

    def _fullkv_traces(self, folder: Path, files: list[SampleFile]) -> dict:
        """{(task, index): fullkv's trace} for every sample; ValueError (one line) for one fullkv's run lacks."""
        from pyramidkv.runner.results import read_unique_rows

        traces = {}
        how = f"run fullkv first with the same flags into the same --save_dir ({folder.parent.parent})"
        for sample_file in files:
            path = folder / sample_file.file_name
            rows = {r["index"]: r for r in read_unique_rows(path, "index", True)} if path.is_file() else {}
            for sample in sample_file.samples:
                row = rows.get(sample.key)
                if row is None:
                    raise ValueError(f"no fullkv trace of {sample.label} in {path}: {how}")
                if row.get("trace_digest") != sample.row["trace_digest"]:
                    raise ValueError(f"fullkv's trace of {sample.label} in {path} was made with another prompt, "
                                     f"--max_new_tokens, sampling or model: {how}, or use another --save_dir")
                traces[(sample_file.name, sample.key)] = row["trace"]
        return traces

    def check_method(self, args, method, files) -> None:
        """fullkv's traces found (plain fullkv is the reference: its own run compares with itself), and a decode
        budget that compresses within the traces' length."""
        from pyramidkv.methods import make_method, method_spec
        from pyramidkv.runner.labels import run_dir

        self.fullkv_run = method_spec(method) == "fullkv"
        fullkv_dir = run_dir(args.save_dir, self.model_label(args), make_method("fullkv"))
        self.references = {} if self.fullkv_run else self._fullkv_traces(fullkv_dir, files)
        decode = getattr(method, "decode", None)
        if decode is None or decode.decode_budget is None:
            return
        for sample_file in files:
            for sample in sample_file.samples:
                held = len(sample.prompt) + sample.max_new_tokens - 1
                if not compresses(len(sample.prompt), sample.max_new_tokens, decode.decode_budget,
                                  decode.decode_interval):
                    raise ValueError(f"--decode_budget {decode.decode_budget} (+ decode_interval {decode.decode_interval})"
                                     f" is above what {sample.label} ever holds ({len(sample.prompt)} prompt + "
                                     f"{sample.max_new_tokens} new tokens): it would never compress while decoding; "
                                     f"use a --decode_budget of at most {held - decode.decode_interval} or more "
                                     f"--max_new_tokens")

    def fingerprint_extra(self, args, tokenizer) -> dict:
        return {"reasoning": {"instructions": [T.CHAIN_INSTRUCTION, T.GSM8K_INSTRUCTION, T.MATH_INSTRUCTION],
                              "answer_prefixes": T.ANSWER_PREFIX}}

    def meta_extra(self, args, files) -> dict:
        return {"fullkv_trace_rule": "read from fullkv's run folder in the same save_dir (docs/reasoning.md)",
                "tasks": {f.name: len(f.samples) for f in files}}

    def decode_sample(self, model, tokenizer, method, sample, sample_file, args) -> dict:
        from pyramidkv.generation.trace import decode_trace

        task = sample.row["task"]
        trace = decode_trace(model, tokenizer, sample.prompt, method, sample.max_new_tokens,
                             sample_file.stop_token_ids, self._sampling_of(task, sample.key),
                             record_logprobs=self.fullkv_run, decode_threads=args.decode_threads)
        reference = trace.tokens if self.fullkv_run else self.references[(sample_file.name, sample.key)]
        compared = kl_along(model, tokenizer, sample.prompt, reference, method, trace.logprobs)
        steps = len(trace.tokens) - 1
        return {"index": sample.key, "task": task, "pred": trace.text,
                **grade(task, T.ANSWER_PREFIX[task] + trace.text, sample.row),
                "new_tokens": trace.new_tokens, "stopped": trace.stopped, "prompt_tokens": trace.prompt_tokens,
                **compared, "departure_step": departure_step(trace.tokens, reference),
                "kv_bytes_peak": max(trace.kv_bytes), "kv_bytes_mean": round(_mean(trace.kv_bytes), 1),
                "kv_bytes": trace.kv_bytes[-1], "prefill_ms": round(1000 * trace.prefill_seconds, 3),
                "decode_tokens_per_s": round(steps / trace.decode_seconds, 3) if steps else None,
                "decode_cpu_tokens_per_s": round(steps / trace.decode_cpu_seconds, 3) if steps and
                trace.decode_cpu_seconds > 0 else None,
                "trace": trace.tokens, "trace_digest": sample.row["trace_digest"]}

    def score(self, args, out_dir, files, method, model) -> dict:
        from pyramidkv.methods import method_spec
        from pyramidkv.runner.results import read_unique_rows

        scores = {}
        for sample_file in files:
            wanted = {s.key for s in sample_file.samples}
            rows = [r for r in read_unique_rows(out_dir / sample_file.file_name, "index") if r["index"] in wanted]
            scores[sample_file.name] = summarize(rows)
        result = {"benchmark": "reasoning", "model": model, "method": method.label(), "method_spec": method_spec(method),
                  "budget": method.sizing.recorded(method), "scores": scores,
                  "average": _mean([s["accuracy"] for s in scores.values()]), "average_metric": "accuracy",
                  "num_samples": {task: s["num_samples"] for task, s in scores.items()}}
        write_results(out_dir, result, ["task", *SCORES, "num_samples"],
                      [[task, *(s[k] for k in SCORES), s["num_samples"]] for task, s in scores.items()])
        return result

    def format(self, result: dict) -> str:
        lines = [f"reasoning  {result['model']} / {result['method']} / budget {result['budget'] or 'full'}"]
        for task, s in result["scores"].items():
            lines.append(f"  {task:8s} accuracy {s['accuracy']}  steps {s['step_accuracy']}  tokens {s['new_tokens']}  "
                         f"KL {s['kl_vs_fullkv']}  departs at {s['departure_step']} ({s['departed']}% of traces)  "
                         f"peak KV {s['kv_bytes_peak']} B  {s['decode_tokens_per_s']} tok/s  (n={s['num_samples']})")
        return "\n".join(lines)


def compresses(prompt_tokens: int, new_tokens: int, decode_budget: int, decode_interval: int) -> bool:
    """Whether a trace of `new_tokens` after `prompt_tokens` outgrows a decode budget: the cache holds prompt + new
    - 1 tokens at the end, and re-selects once it holds budget + interval."""
    return prompt_tokens + new_tokens - 1 >= decode_budget + decode_interval


def grade(task: str, text: str, row: dict) -> dict:
    """The row's answer fields: what was extracted, whether it is right, and for chain the share of right steps."""
    if task == "math500":
        answer = last_boxed(text)
        return {"answer": answer, "correct": math_equal(answer, row["reference"])}
    answer = gsm8k_answer(text)
    out = {"answer": answer, "correct": answer == row["reference"]}
    if task == "chain":
        found = chain_steps(text)
        out["step_accuracy"] = sum(found.get(i) == v for i, v in enumerate(row["steps"], 1)) / len(row["steps"])
    return out


def summarize(rows: list[dict]) -> dict:
    """Per task: accuracy and step accuracy (x100), means of the rest; departure_step: the mean step of the traces
    that depart (their share: departed, x100)."""
    def pct(values):
        m = _mean(values)
        return None if m is None else round(100 * m, 2)

    def avg(key, digits=3):
        m = _mean(r.get(key) for r in rows)
        return None if m is None else round(m, digits)

    return {"accuracy": pct(r["correct"] for r in rows), "step_accuracy": pct(r.get("step_accuracy") for r in rows),
            "new_tokens": avg("new_tokens", 1), "kl_vs_fullkv": avg("kl_vs_fullkv", 6),
            "departure_step": avg("departure_step", 1),
            "departed": pct(r["departure_step"] is not None for r in rows),
            "kv_bytes_peak": avg("kv_bytes_peak", 0), "kv_bytes_mean": avg("kv_bytes_mean", 0),
            "decode_tokens_per_s": avg("decode_tokens_per_s", 2), "num_samples": len(rows)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_benchmark(Reasoning(), argv)


def build_parser() -> argparse.ArgumentParser:
    return protocol_parser(Reasoning())
