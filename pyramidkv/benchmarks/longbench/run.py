"""LongBench v1 runner: official prompts, middle truncation, chat templates, resumable results.

`run_longbench.py` at the repository root calls `main`. The steps for each dataset:

1. rows from `{data_dir}/{dataset}.jsonl` (or the Hugging Face hub when no --data_dir);
2. the official prompt `dataset2prompt[dataset].format(**row)`, tokenized without special tokens;
3. over `max_length` tokens: keep the first and last `max_length // 2` tokens (middle truncation);
4. the chat template around it (not for trec, triviaqa, samsum, lsht, lcc, repobench-p);
5. greedy decoding of at most `dataset2maxlen[dataset]` tokens under the compression method
   (samsum also stops at a newline and generates at least one token, as the official harness does);
6. one JSONL row per sample in `{save_dir}/{model}_{budget}/{method}/{dataset}.jsonl`,
   flushed as soon as written; a rerun skips the `_id`s already there.

With --question_as_decode the question part (`question_part`: the template's text after {context}, filled in,
then the chat template's closing) is fed as decode steps after the rest is prefilled.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from array import array
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

DATA_DIR = Path(__file__).resolve().parent / "data"

# The 16 English and code datasets that KV-cache compression papers report, in the usual order.
ENGLISH_DATASETS = (
    "narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique",
    "gov_report", "qmsum", "multi_news", "trec", "triviaqa", "samsum",
    "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
# All 21 LongBench v1 datasets (the official order).
ALL_DATASETS = (
    "narrativeqa", "qasper", "multifieldqa_en", "multifieldqa_zh", "hotpotqa", "2wikimqa", "musique",
    "dureader", "gov_report", "qmsum", "multi_news", "vcsum", "trec", "triviaqa", "samsum", "lsht",
    "passage_count", "passage_retrieval_en", "passage_retrieval_zh", "lcc", "repobench-p",
)
# LongBench-E (uniform length distribution): the 13 datasets it has.
E_DATASETS = (
    "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "gov_report", "multi_news",
    "trec", "triviaqa", "samsum", "passage_count", "passage_retrieval_en", "lcc", "repobench-p",
)
# Few-shot and code tasks: chat models do better on the raw prompt (official rule).
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

REQUIRED_FIELDS = ("_id", "answers", "length")
HUB_DATASET = "THUDM/LongBench"

from pyramidkv.benchmarks.prompting import chat_frame  # noqa: E402
from pyramidkv.runner.protocol import Benchmark, Sample, SampleFile, achieved, block_fields, run_benchmark  # noqa: E402
from pyramidkv.runner.protocol import build_parser as protocol_parser  # noqa: E402


@lru_cache(maxsize=None)
def dataset2prompt() -> dict:
    return json.loads((DATA_DIR / "dataset2prompt.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def dataset2maxlen() -> dict:
    return json.loads((DATA_DIR / "dataset2maxlen.json").read_text(encoding="utf-8"))


@lru_cache(maxsize=None)
def model2maxlen() -> dict[str, int]:
    """The official prompt-token budgets by lowercased name: each of the official config's model names and
    the last component of its hub id (model2path.json), e.g. both llama2-7b-chat-4k and llama-2-7b-chat-hf."""
    budgets = json.loads((DATA_DIR / "model2maxlen.json").read_text(encoding="utf-8"))
    paths = json.loads((DATA_DIR / "model2path.json").read_text(encoding="utf-8"))
    named = {name.lower(): value for name, value in budgets.items()}
    named.update({paths[name].rsplit("/", 1)[-1].lower(): value for name, value in budgets.items() if name in paths})
    return named


# --- datasets and data -------------------------------------------------------------------------

def resolve_datasets(names: Sequence[str], longbench_e: bool = False) -> list[str]:
    """Expand the --datasets value (names, comma lists, or `all`) and check every name."""
    allowed = E_DATASETS if longbench_e else ALL_DATASETS
    default = E_DATASETS if longbench_e else ENGLISH_DATASETS
    if not names:
        return list(default)
    wanted: list[str] = []
    for item in names:
        for name in (part.strip() for part in item.split(",")):
            if not name:
                continue
            if name == "all":
                wanted.extend(allowed)
            elif name not in allowed:
                kind = "LongBench-E" if longbench_e else "LongBench"
                raise ValueError(f"unknown {kind} dataset {name!r}; choose from: all, {', '.join(allowed)}")
            else:
                wanted.append(name)
    unique = list(dict.fromkeys(wanted))
    if not unique:
        raise ValueError("--datasets is empty")
    return unique


def data_file(data_dir: Path, dataset: str, longbench_e: bool = False) -> Path:
    name = f"{dataset}_e" if longbench_e else dataset
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"--data_dir {data_dir} does not exist or is not a folder; it must hold the "
                                f"official LongBench JSONL files ({name}.jsonl, ...)")
    for candidate in (data_dir / f"{name}.jsonl", data_dir / "data" / f"{name}.jsonl"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{data_dir / (name + '.jsonl')} not found: --data_dir must hold the official "
                            f"LongBench file {name}.jsonl (unzip data.zip from the THUDM/LongBench dataset)")


def _load_from_hub(dataset: str, longbench_e: bool) -> list[dict]:
    name = f"{dataset}_e" if longbench_e else dataset
    advice = ("download data.zip from https://huggingface.co/datasets/THUDM/LongBench, unzip it and pass "
              "--data_dir path/to/data")
    try:
        import datasets
    except ImportError:
        raise RuntimeError(f"no --data_dir given and the `datasets` package is not installed; {advice}") from None
    try:
        data = datasets.load_dataset(HUB_DATASET, name, split="test")
    except Exception as e:  # noqa: BLE001 - offline, gated, script-based: all end the same way
        raise RuntimeError(f"could not load {HUB_DATASET} ({name}) from the Hugging Face hub "
                           f"({type(e).__name__}: {e}). Offline? {advice}") from e
    return [dict(row) for row in data]


def load_rows(dataset: str, data_dir: Optional[Path], longbench_e: bool = False) -> list[dict]:
    """The dataset's rows, checked: each has _id, a list of answers and length, and _ids are unique.

    Row numbers in errors are the file's line numbers (for the hub, positions from 1).
    """
    from pyramidkv.runner.results import iter_jsonl

    if data_dir is not None:
        source = data_file(data_dir, dataset, longbench_e)
        numbered = list(iter_jsonl(source))
        if not numbered:
            raise ValueError(f"{source}: no rows (an empty data file); expected the official LongBench JSONL")
    else:
        source = f"{HUB_DATASET}/{dataset}{'_e' if longbench_e else ''}"
        numbered = list(enumerate(_load_from_hub(dataset, longbench_e), start=1))
    fields = set(REQUIRED_FIELDS) | _template_fields(dataset)
    seen: set = set()
    for number, row in numbered:
        missing = sorted(fields - row.keys())
        if missing:
            raise ValueError(f"{source}: row {number} lacks field(s) {', '.join(missing)}")
        if row["_id"] in seen:
            raise ValueError(f"{source}: row {number} repeats _id {row['_id']!r}")
        seen.add(row["_id"])
        if not isinstance(row["answers"], list):
            raise ValueError(f"{source}: row {number}: 'answers' must be a list of reference answers, "
                             f"got {type(row['answers']).__name__} {row['answers']!r}")
    return [row for _, row in numbered]


def question_part(dataset: str, row: dict) -> tuple[str, Optional[int]]:
    """(the official prompt, the character offset where its question part begins): everything the template
    puts after {context} (the question, the instruction after the material, "Answer:"; for the few-shot
    tasks the sample's own passage or dialogue). None when the template has nothing but whitespace there."""
    template = dataset2prompt()[dataset]
    text = template.format(**row)
    _, found, tail = template.partition("{context}")
    if not found or not tail.strip():
        return text, None
    return text, len(text) - len(tail.format(**row))


def check_question_parts(datasets: Sequence[str], flag: str = "--question_as_decode") -> None:
    """--question_as_decode / --shared_context: every dataset's template must have a question part after its
    context (LongBench asks one question per context)."""
    without = [d for d in datasets if question_part(d, {f: "x" for f in _template_fields(d)})[1] is None]
    if without:
        raise ValueError(f"{flag}: the prompt template of {', '.join(without)} has nothing after "
                         f"its context to feed as the question; run {'it' if len(without) == 1 else 'them'} "
                         f"without {flag}")


def _template_fields(dataset: str) -> set:
    import string

    return {field for _, field, _, _ in string.Formatter().parse(dataset2prompt()[dataset]) if field}


def select_rows(rows: list[dict], max_num_examples: Optional[int], sample_method: str = "topk",
                seed: int = 42) -> list[dict]:
    """topk: the first N rows; random: N rows drawn with `seed`, kept in file order."""
    if max_num_examples is None or max_num_examples >= len(rows):
        return list(rows)
    if sample_method == "topk":
        return list(rows[:max_num_examples])
    if sample_method == "random":
        picked = sorted(random.Random(seed).sample(range(len(rows)), max_num_examples))
        return [rows[i] for i in picked]
    raise ValueError(f"unknown sample_method {sample_method!r}; choose topk or random")


# --- prompts -----------------------------------------------------------------------------------

def middle_truncate(tokens: Sequence[int], max_length: int) -> list[int]:
    """Keep the first and the last max_length // 2 tokens of an over-long prompt (official rule)."""
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    tokens = list(tokens)
    if len(tokens) <= max_length:
        return tokens
    half = max_length // 2
    return tokens[:half] + tokens[len(tokens) - half:]


def known_max_length(model_path: str) -> Optional[int]:
    """The official budget of a model named exactly (case aside) as the official config names it or as the last
    component of its hub id: the last component of `model_path` (a folder or a hub id); None for any other name."""
    return model2maxlen().get(Path(str(model_path).rstrip("/")).name.lower())


class PromptBuilder:
    """Turns a LongBench row into prompt token ids for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._chat = self._chat_wrapper()
        probe = tokenizer("a", add_special_tokens=True).input_ids
        plain = tokenizer("a", add_special_tokens=False).input_ids
        # Leading special tokens (a BOS) that the tokenizer adds on its own: used for raw prompts.
        self.leading_specials = probe[: len(probe) - len(plain)] if probe[len(probe) - len(plain):] == plain else []

    def _chat_wrapper(self) -> Optional[tuple[list[int], list[int]]]:
        tok = self.tokenizer
        if getattr(tok, "chat_template", None) is None:
            return None
        before, after = chat_frame(tok)          # the template's own rendering of a lone user turn
        encode = lambda s: tok(s, add_special_tokens=False).input_ids if s else []  # noqa: E731
        return encode(before), encode(after)

    @property
    def has_chat_template(self) -> bool:
        return self._chat is not None

    def template_overhead(self) -> int:
        if self._chat is None:
            return len(self.leading_specials)
        return len(self._chat[0]) + len(self._chat[1])

    def build(self, dataset: str, row: dict, max_length: int) -> tuple[list[int], bool]:
        """(token ids, truncated?) of the row's full prompt."""
        text = dataset2prompt()[dataset].format(**row)
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        before, after = self._frame(dataset)
        return before + middle_truncate(ids, max_length) + after, len(ids) > max_length

    def build_with_question(self, dataset: str, row: dict, max_length: int) -> tuple[list[int], Optional[int]]:
        """(the token ids `build` gives, the index of the question part's first token; None when the
        template has none): the kept tokens from the template's text after {context} (`question_part`)
        and the chat template's closing. When middle truncation cuts into the question part, the question
        is the kept tail (everything after the cut)."""
        from pyramidkv.generation import split_prompt

        text, start = question_part(dataset, row)
        if start is None:
            return self.build(dataset, row, max_length)[0], None
        context, question = split_prompt(self.tokenizer, text, start)
        ids, cut = context + question, len(context)
        if len(ids) > max_length:                # kept: ids[:half] + ids[-half:]
            half = max_length // 2
            cut = cut if cut <= half else max(half, cut - (len(ids) - 2 * half))
        before, after = self._frame(dataset)
        return before + middle_truncate(ids, max_length) + after, len(before) + cut

    def _frame(self, dataset: str) -> tuple[list[int], list[int]]:
        """(token ids before, after) the prompt: the chat template's, or a raw prompt's leading specials."""
        if dataset not in NO_CHAT_TEMPLATE and self._chat is not None:
            return self._chat
        return self.leading_specials, []


def resolve_max_length(model_path: str, config, dataset: str, max_new_tokens: int, template_overhead: int,
                       override: Optional[int] = None) -> tuple[int, str]:
    """(prompt tokens kept, the rule that gave them): --max_length; else the official budget of a model the
    official config names (`known_max_length`); else the model's context window less the dataset's new tokens
    and the chat template's tokens, capped at the largest official budget (longer windows keep the official
    harness's longest prompts, not more)."""
    if override is not None:
        return override, "--max_length"
    known = known_max_length(model_path)
    if known is not None:
        return known, f"model2maxlen.json ({Path(str(model_path).rstrip('/')).name})"
    window = getattr(config, "max_position_embeddings", None)
    if not window:
        raise ValueError(f"cannot tell the context length of {model_path!r} (no max_position_embeddings in its "
                         f"config); pass --max_length")
    cap = max(model2maxlen().values())
    budget = min(int(window) - max_new_tokens - template_overhead, cap)
    if budget < 2:
        raise ValueError(f"{model_path!r}: context {window} leaves no room for a {dataset} prompt "
                         f"({max_new_tokens} new tokens); pass --max_length")
    return budget, (f"max_position_embeddings {window} - new tokens - {template_overhead} chat-template tokens, "
                    f"at most {cap}")


def stop_token_ids(generation_config, tokenizer, dataset: str) -> list[int]:
    """The model's end tokens (generation.end_token_ids: generation config, tokenizer, chat template), plus
    newline for samsum."""
    from pyramidkv.generation import end_token_ids

    ids = end_token_ids(tokenizer, generation_config)
    if dataset == "samsum":
        # The official harness stops samsum at a newline: models otherwise go on with "\nDialogue: ...".
        ids.append(tokenizer.encode("\n", add_special_tokens=False)[-1])
    return list(dict.fromkeys(ids))


# --- the benchmark adapter ---------------------------------------------------------------------

class LongBench(Benchmark):
    name = "longbench"
    prog = "run_longbench.py"
    description = "Run LongBench v1 with a KV-cache compression method; `--eval` scores the run afterwards."
    key = "_id"
    input_paths = ("data_dir",)
    selection_args = {
        "datasets": "which dataset files run (one predictions file per dataset)",
        "max_num_examples": "how many samples run; each prediction row is keyed and checked on its own",
    }
    scoring_args = {"eval": "score afterwards"}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        d = parser.add_argument_group("LongBench")
        d.add_argument("--data_dir", default=None,
                       help="folder with the official {dataset}.jsonl files; without it the data comes from the "
                            f"Hugging Face hub ({HUB_DATASET}), which needs network access")
        d.add_argument("--datasets", nargs="+", default=None,
                       help="dataset names (space or comma separated) or `all` (21); when not given: the 16 "
                            "English/code datasets (" + " ".join(ENGLISH_DATASETS) + ")")
        d.add_argument("--e", action="store_true", help="LongBench-E: {dataset}_e files, length-bucket scores")
        d.add_argument("--max_num_examples", type=int, default=None, help="at most this many samples per dataset")
        d.add_argument("--sample_method", choices=["topk", "random"], default="topk",
                       help="with --max_num_examples: the first N rows (topk) or N random rows (random, --seed)")
        d.add_argument("--seed", "--sample_seed", type=int, default=42,
                       help="with --sample_method random: the seed that draws the rows (decoding is greedy: nothing "
                            "else is random); --sample_seed when the method has a seed of its own (CaM's, GEAR's)")
        d.add_argument("--eval_batch_size", type=int, default=1, help="prompts per batch (left-padded)")
        d.add_argument("--max_length", type=int, default=None,
                       help="prompt tokens kept (middle truncation); when not given: the official value for a model "
                            "its model2maxlen.json names (the model path's last component, case aside), else the "
                            "model's context window minus the dataset's new tokens and the chat template, at most "
                            "the largest official value (docs/longbench.md)")
        d.add_argument("--max_new_tokens", type=int, default=None,
                       help="override the official per-dataset generation length (smoke tests only)")
        d.add_argument("--save_dir", default="results/longbench",
                       help="results go to {save_dir}/{model}_{budget}/{method}/{dataset}.jsonl")
        d.add_argument("--eval", action="store_true", help="score the run when it is done (same code as eval.py)")

    def check_arguments(self, args) -> None:
        for flag in ("max_num_examples", "eval_batch_size", "max_new_tokens"):
            value = getattr(args, flag)
            if value is not None and value < 1:
                raise ValueError(f"--{flag} must be >= 1, got {value}")
        if "seed" in self.given and args.sample_method != "random":
            raise ValueError(f"{self.given['seed']} {args.seed} has no effect: it draws the rows of --sample_method "
                             f"random, and decoding is greedy; give --sample_method random, or leave it out")
        if args.sample_method == "random" and args.max_num_examples is None:
            raise ValueError("--sample_method random has no effect without --max_num_examples (every row is used)")
        if args.max_length is not None and args.max_length < 2:
            raise ValueError(f"--max_length must be >= 2, got {args.max_length}")
        self.datasets = resolve_datasets(args.datasets, args.e)
        if args.question_as_decode or args.shared_context:
            check_question_parts(self.datasets, "--shared_context" if args.shared_context else "--question_as_decode")

    def prepare(self, args, tokenizer, config, out_dir):
        suffix = "_e" if args.e else ""
        builder = PromptBuilder(tokenizer)
        if not builder.has_chat_template:
            print(f"note: {args.model_path} has no chat template; every prompt is used as is", file=sys.stderr)
        if args.max_length is not None and args.max_length < builder.template_overhead():
            raise ValueError(f"--max_length {args.max_length} is shorter than the chat template's "
                             f"{builder.template_overhead()} tokens around the prompt: the sample would be mostly "
                             f"template; give at least {builder.template_overhead()}")
        self.max_new = {d: args.max_new_tokens or dataset2maxlen()[d] for d in self.datasets}
        resolved = {d: resolve_max_length(args.model_path, config, d, self.max_new[d], builder.template_overhead(),
                                          args.max_length) for d in self.datasets}
        self.max_len = {d: length for d, (length, _) in resolved.items()}
        self.max_len_rule = next(iter(resolved.values()))[1]
        files = []
        for dataset in self.datasets:
            rows = load_rows(dataset, Path(args.data_dir) if args.data_dir is not None else None, args.e)
            samples = []
            for row in select_rows(rows, args.max_num_examples, args.sample_method, args.seed):
                if args.question_as_decode or args.shared_context:
                    ids, question_start = builder.build_with_question(dataset, row, self.max_len[dataset])
                else:
                    (ids, _), question_start = builder.build(dataset, row, self.max_len[dataset]), None
                samples.append(Sample(row["_id"], array("l", ids), self.max_new[dataset],
                                      {"answers": row["answers"], "all_classes": row.get("all_classes"),
                                       "length": row["length"]}, f"{dataset}: sample {row['_id']}",
                                      question_start=question_start,
                                      reference=row["answers"][0] if row["answers"] else None))
            files.append(SampleFile(dataset, f"{dataset}{suffix}.jsonl", samples, dataset,
                                    min_new_tokens=1 if dataset == "samsum" else 0))
        return files

    def meta_extra(self, args, files) -> dict:
        return {"benchmark": "longbench-e" if args.e else "longbench", "datasets": self.datasets,
                "max_length": self.max_len, "max_length_rule": self.max_len_rule, "max_new_tokens": self.max_new}

    def stop_token_ids(self, generation_config, tokenizer, sample_file):
        return stop_token_ids(generation_config, tokenizer, sample_file.name)

    def prediction_row(self, sample, output) -> dict:
        return {"_id": sample.key, "pred": output.text, **sample.row, "prompt_tokens": output.prompt_tokens,
                "kv_bytes": output.kv_bytes_per_prompt, **achieved(output), **block_fields(output)}

    def score(self, args, out_dir, files, method, model):
        if not args.eval:
            return None
        from pyramidkv.benchmarks.longbench.evaluate import evaluate_run_dir

        return evaluate_run_dir(out_dir, longbench_e=args.e)

    def format(self, result: dict) -> str:
        from pyramidkv.benchmarks.longbench.evaluate import format_table

        return format_table([result])


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run_benchmark(LongBench(), argv)


def build_parser() -> argparse.ArgumentParser:
    return protocol_parser(LongBench())
