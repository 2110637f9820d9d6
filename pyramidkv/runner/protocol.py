"""The run protocol every benchmark runner follows; a benchmark is an adapter that supplies its own flags,
its samples and its scorer (CONTRIBUTING.md, "a benchmark").

    parse (common flags + the benchmark's) -> every check that needs no model (flags, method, data, model
    config, each sample's length against the model and the method) -> the run folder as a `with` block
    (lock, fingerprint, run_meta.json, crash-safe writers, disk full) -> the model, loaded only when a
    sample is pending -> batches -> generate -> one appended row per sample -> scoring -> results.json /
    results.csv and the printed table.

`--question_as_decode` (Quest's evaluation protocol): each sample's tokens are cut where its question part
begins (`Sample.question_start`, set by the adapter); the context is prefilled (and compressed) and the
question is appended before the answer (`generate(..., questions=...)`): in one forward, each decode-time unit
deciding as if its tokens came one per decode step.

`--shared_context multi_request|multi_turn` (compress once, ask many: runner/shared.py): each context is
compressed once and its questions (`Sample.questions`, or the part after `question_start`) are answered from it,
one row per question keyed `qid` with its `turn`. A sample with several questions and no --shared_context asks
each inside its own prompt (context + question prefilled together): the same rows, today's protocol.

A bad input ends the run with one line (`<prog>: error: ...`, exit status 2) before anything is written.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.core.chunked import PrefillChunks
from pyramidkv.generation.shared import MODES
from pyramidkv.runner.shared import (  # noqa: F401 (Question: the adapters')
    Question, cache_configuration, check_cache_file_flags, check_cache_files, decode_questions,
)
from pyramidkv.runner.arguments import ArgumentParser
from pyramidkv.runner.divergence import check_kl_flags
from pyramidkv.runner.batching import achieved, batches, block_fields, load_run_model  # noqa: F401 (the adapters')
from pyramidkv.runner.cli import (
    INPUT_ERRORS, HelpScope, UnfitPrompt, add_model_and_method_args, check_run_args, fail,
)
from pyramidkv.runner.labels import QUESTION_AS_DECODE_SUFFIX, model_label, run_dir
from pyramidkv.runner.method_args import (
    check_model_args, check_shared_names, effective_method, method_from_args, method_inputs,
)


@dataclass
class Sample:
    """One prompt to decode: its row key, token ids, generation length, and the fields its prediction row
    carries besides the output (references, lengths, ...)."""

    key: object
    prompt: Sequence[int]
    max_new_tokens: int
    row: Optional[dict] = None            # fields the prediction row carries besides the output
    label: str = ""                       # how errors name the sample ("sample 3 of niah_single_1_4096.jsonl")
    batch_group: object = None            # samples are batched only with others of the same group
    question_start: Optional[int] = None  # index in `prompt` of the question part's first token (everything
                                          # after the context: question, instruction, chat framing, answer
                                          # prefix); set by the adapter under --question_as_decode
    questions: Optional[list[Question]] = None   # several questions on one context (`prompt`): one row each
                                          # (runner/shared.py); set by the adapter
    reference: Optional[str] = None       # the reference answer's text, scored teacher forced after the prompt
                                          # under --kl_vs_fullkv (runner/divergence.py); set by the adapter


@dataclass
class SampleFile:
    """The samples whose predictions go to one file of the run folder."""

    name: str                             # what progress and errors call it ("niah_single_1@4096", "multi_news")
    file_name: str                        # the predictions file in the run folder
    samples: list[Sample]
    source: str = ""                      # where the samples came from
    stop_token_ids: Optional[list[int]] = None   # None: the model's end tokens (generation.end_token_ids);
                                                 # the run sets it before decoding (Benchmark.stop_token_ids)
    min_new_tokens: int = 0


class Benchmark:
    """The adapter a benchmark implements. `key` names the prediction rows' key field."""

    name = ""
    prog = ""
    description = ""
    key = "index"
    given: dict = {}        # {dest: the option as typed} of this run's command line (set before check_arguments)
    # Batches of more than one sample are formed longest prompt first (see `batches`), so the rows of a file
    # come batch by batch; only for a benchmark whose scores do not depend on the order of the rows.
    batch_by_length = False
    # The flags (dests) that name a file or folder the run reads: fingerprinted by content (run_folder.input_files).
    input_paths: tuple[str, ...] = ()
    # The flags (dests) that only choose which samples run, each with why that cannot change a prediction (each
    # row is keyed and checked on its own): left out of the run's fingerprint (run_folder.py), so a resumed run
    # may choose more samples, or others. Every other flag of the benchmark is fingerprinted.
    selection_args: dict[str, str] = {}
    # The flags (dests) that only change what is done with the predictions once made (a scoring switch), likewise.
    scoring_args: dict[str, str] = {}

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        """The benchmark's own flags (its --save_dir included)."""

    def check_arguments(self, args: argparse.Namespace) -> None:
        """ValueError (one line) for a bad combination of the benchmark's flags."""

    def model_label(self, args: argparse.Namespace) -> str:
        return model_label(args.model_path)

    def prepare(self, args, tokenizer, config, out_dir: Path) -> list[SampleFile]:
        """Every sample of the run, tokenized, before any weights load (ValueError for bad data); with
        args.question_as_decode each sample's question_start (the first token after its context)."""
        raise NotImplementedError

    def check_resume(self, path: Path, sample_file: SampleFile) -> None:
        """Predictions already in `path` must belong to these samples (by default: each key, or question, once)."""
        from pyramidkv.runner.results import read_unique_rows

        several = any(sample.questions for sample in sample_file.samples)   # one row per question (runner/shared.py)
        read_unique_rows(path, "qid" if several else self.key, skip_torn_last_line=True)

    def fingerprint_extra(self, args, tokenizer) -> Optional[dict]:
        """Facts beyond the arguments that decide the predictions (the needle text, a haystack hash)."""
        return None

    def meta_extra(self, args, files: list[SampleFile]) -> dict:
        return {}

    def check_method(self, args, method, files: list[SampleFile]) -> None:
        """ValueError (one line) for what the method cannot do on these samples, before any weights load (the
        protocol has checked each prompt against it already: check_samples)."""

    # A benchmark that decodes each sample its own way (one trace per sample, compared with fullkv's: the reasoning
    # runner) sets this to a function (model, tokenizer, method, sample, sample_file, args) -> the prediction row;
    # None: the protocol's batched generate and `prediction_row`.
    decode_sample = None

    def stop_token_ids(self, generation_config, tokenizer, sample_file: SampleFile) -> list[int]:
        """The ids that stop a sample's answer: the file's own, else the model's end tokens (its generation
        config's eos ids, the tokenizer's eos, the chat template's end of turn: generation.end_token_ids)."""
        from pyramidkv.generation import end_token_ids

        if sample_file.stop_token_ids is not None:
            return sample_file.stop_token_ids
        return end_token_ids(tokenizer, generation_config)

    def prediction_row(self, sample: Sample, output) -> dict:
        return {self.key: sample.key, "pred": output.text, **(sample.row or {}), "prompt_tokens": output.prompt_tokens,
                "kv_bytes": output.kv_bytes_per_prompt, **achieved(output), **block_fields(output)}

    def question_row(self, sample: Sample, question, output) -> dict:
        """What a question's row (several questions per context: runner/shared.py) adds over `prediction_row`: by
        default the question's own fields (its references)."""
        return dict(question.row or {})

    def score(self, args, out_dir: Path, files: list[SampleFile], method, model: str) -> Optional[dict]:
        """Score the run and write its results files (write_results); None: no scoring this run."""
        return None

    def format(self, result: dict) -> str:
        return ""


def write_results(out_dir: Path, result: dict, header: Sequence[str], rows: Sequence[Sequence]) -> None:
    """results.json (the common schema) and results.csv (one row per task plus the average), atomically."""
    from pyramidkv.runner.results import atomic_write_json, atomic_write_text

    atomic_write_json(out_dir / "results.json", result)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    atomic_write_text(out_dir / "results.csv", text.getvalue())


def build_parser(benchmark: Benchmark, argv: Optional[Sequence[str]] = None) -> ArgumentParser:
    """The runner's parser (runner/arguments.py: no abbreviations, no setting given twice, ASCII numbers);
    when `argv` asks for --help with a --method, the help shows that method's settings only."""
    parser = ArgumentParser(prog=benchmark.prog, description=benchmark.description,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    benchmark.add_arguments(parser)
    parser.benchmark_flags = set(parser._option_string_actions) - {"-h", "--help"}
    parser.benchmark_name = benchmark.name
    try:
        scope = _help_scope(argv)
    except ValueError as e:   # --method bogus --help: refused, not every method's help
        parser.error(f"--method: {e}")
    add_model_and_method_args(parser, scope)
    p = parser.add_argument_group("protocol")
    p.add_argument("--question_as_decode", action="store_true",
                   help="prefill only each prompt's context and feed its question part (everything after the "
                        "context, chat framing and answer prefix included) after it, "
                        "seen by decode-time selection only, as Quest's paper measures (one forward; every "
                        "decode-time unit decides as if the tokens came one per decode step); when not given: the whole prompt is prefilled. The run folder "
                        f"gets the suffix {QUESTION_AS_DECODE_SUFFIX}")
    p.add_argument("--shared_context", choices=MODES, default=None,
                   help="compress each context once, without its question, and answer its questions from it: "
                        "multi_request rolls the cache back to the compressed context before each question, "
                        "multi_turn keeps each question and answer in the cache (a conversation); one row per "
                        "question with its turn. The run folder gets the suffix _{mode}; when not given: each "
                        "question inside its own prompt")
    p.add_argument("--save_compressed", default=None, metavar="DIR",
                   help="with --shared_context: write each context's cache right after compression to "
                        "DIR/{model}_{budget}/{method folder}/{predictions file}/{key}.safetensors (pyramidkv."
                        "save_cache; a file of another configuration there is refused, never replaced); needs "
                        "--eval_batch_size 1")
    p.add_argument("--load_compressed", default=None, metavar="DIR",
                   help="with --shared_context: a context whose file --save_compressed wrote is answered from it, "
                        "not compressed again (same model, method and context token ids, else refused); needs "
                        "--eval_batch_size 1")
    p.add_argument("--kl_vs_fullkv", action="store_true",
                   help="also feed each sample's reference answer teacher forced after its prompt (the same compressed "
                        "prefill) and record the mean KL divergence of the next-token distributions from fullkv's, "
                        "computed once per sample and kept in SAVE_DIR/fullkv_reference (runner/divergence.py)")
    p.add_argument("--prepare_only", action="store_true",
                   help="every check that needs no weights, on every sample (the data generated and tokenized), then "
                        "print the run folder and exit (the leaderboard checks its whole grid so)")
    if "--print_run_dir" not in parser._option_string_actions:
        parser.add_argument("--print_run_dir", action="store_true",
                            help="print the run folder these arguments write to and exit (used by eval.sh)")
    return parser


def _help_scope(argv: Optional[Sequence[str]]) -> Optional[HelpScope]:
    """The method whose settings --help shows: the --method value when argv asks for help (None: all); ValueError
    for a --method value that names no method."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not {"-h", "--help"} & set(argv):
        return None
    for i, word in enumerate(argv):
        if word.startswith("--method="):
            return HelpScope.of(word.partition("=")[2])
        if word == "--method" and i + 1 < len(argv):
            return HelpScope.of(argv[i + 1])
    return None


def run_benchmark(benchmark: Benchmark, argv: Optional[Sequence[str]] = None) -> int:
    """The whole run (see the module docstring); returns the exit status."""
    parser = build_parser(benchmark, argv)
    args = parser.parse_args(argv)
    benchmark.given = parser.given
    try:
        check_run_args(parser, args)
        if args.shared_context and args.question_as_decode:
            raise ValueError("--shared_context already feeds each question after its context: leave out "
                             "--question_as_decode")
        check_cache_file_flags(args)
        benchmark.check_arguments(args)
        method = method_from_args(args, parser)
        check_shared_names(parser, method)
        PrefillChunks(args.prefill_chunk_size).check(method)
    except (ValueError, TypeError) as e:
        fail(parser, e)
    # The folder is named after the model's config is read: the method's settings are checked against the model
    # and written as what they are on it (effective_method), so one configuration has one folder.
    try:
        try:
            model_check = check_model_args(args, method)
        except ValueError as e:
            raise ValueError(_with_typed_flags(parser, args, str(e))) from None
        method = effective_method(method, model_check)
        out_dir = run_dir(args.save_dir, benchmark.model_label(args), method, args.question_as_decode,
                          args.shared_context, args.prefill_chunk_size)
    except INPUT_ERRORS as e:
        fail(parser, e)
    if args.print_run_dir:
        print(out_dir)
        return 0

    from pyramidkv.models.loading import generation_config
    from pyramidkv.runner.run_folder import (
        check_writable, exit_on_disk_full, input_files, open_run_folder, run_fingerprint,
    )

    try:
        from transformers import AutoTokenizer

        config = model_check[1]
        tokenizer = AutoTokenizer.from_pretrained(model_check[0])
        files = benchmark.prepare(args, tokenizer, config, out_dir)
        check_samples(files, method, config, args.model_path, args.question_as_decode or bool(args.shared_context),
                      "--shared_context" if args.shared_context else "--question_as_decode")
        if args.load_compressed or args.save_compressed:
            from pyramidkv.generation.cache_file import identity_before_loading

            check_cache_files(args, files, method, cache_configuration(benchmark, args, method),
                              identity_before_loading(config, model_check[3]))
        check_kl_flags(args, files)
        benchmark.check_method(args, method, files)
        if args.prepare_only:
            print(out_dir)
            return 0
        check_writable(out_dir)
        generation = generation_config(model_check[0], config)
        for sample_file in files:
            sample_file.stop_token_ids = benchmark.stop_token_ids(generation, tokenizer, sample_file)
        for sample_file in files:
            if (out_dir / sample_file.file_name).is_file():
                benchmark.check_resume(out_dir / sample_file.file_name, sample_file)
        inputs = input_files({**method_inputs(method, config), **benchmark_inputs(benchmark, args)})
        ignored = not_generating_args(benchmark)
        fingerprint = run_fingerprint(args, method, model_check, benchmark.fingerprint_extra(args, tokenizer), inputs,
                                      ignored)
        lock = open_run_folder(out_dir, fingerprint, args.overwrite,
                               {action.dest: action.default for action in parser._actions},
                               method.settings_at_default(), ignored)
    except INPUT_ERRORS as e:
        fail(parser, e)

    from pyramidkv.methods import method_spec
    from pyramidkv.runner.results import write_run_meta

    result = None
    try:
        with exit_on_disk_full(out_dir):
            write_run_meta(out_dir, _recorded_arguments(args), method, extra={
                "benchmark": benchmark.name, "method_spec": method_spec(method),
                "resolved_model_path": str(model_check[0]), "input_files": inputs,
                "stop_tokens": {f.name: tokenizer.convert_ids_to_tokens(f.stop_token_ids) for f in files},
                "stop_token_ids": {f.name: f.stop_token_ids for f in files}, **benchmark.meta_extra(args, files),
            }, fingerprint=fingerprint)
            print(f"results -> {out_dir}")
            decode_pending(args, method, benchmark, files, out_dir)
            try:
                result = benchmark.score(args, out_dir, files, method, benchmark.model_label(args))
            except ValueError as e:
                fail(parser, e)
    finally:
        lock.release()
    if result is not None:
        print(benchmark.format(result))
    return 0


def not_generating_args(benchmark: Benchmark) -> dict[str, str]:
    """{dest: why} of the benchmark's flags that cannot change a prediction (its selection and scoring flags), which
    the run's fingerprint leaves out beside the runner's own (run_folder.NON_GENERATING_ARGS)."""
    return {**benchmark.selection_args, **benchmark.scoring_args}


def benchmark_inputs(benchmark: Benchmark, args: argparse.Namespace) -> dict[str, str]:
    """{"--flag=value": value} of each file or folder the benchmark's flags name (a list flag: each value)."""
    out = {}
    for dest in benchmark.input_paths:
        value = getattr(args, dest, None)
        for given in ([] if value is None else value if isinstance(value, list) else [value]):
            out[f"--{dest}={given}"] = str(given)
    return out


def _with_typed_flags(parser, args, message: str) -> str:
    """The message prefixed with the setting flags the user typed that it names (by their setting's field)."""
    import re

    typed = getattr(parser, "typed_flags", {})
    named = []
    for dest, flag in typed.items():
        field = dest.split("_", 1)[1] if dest.startswith(("quant_", "merge_", "head_", "layer_")) else dest
        if any(re.search(rf"\b{re.escape(n)}\b", message) for n in {dest, field}) and flag not in message:
            named.append(f"{flag} {getattr(args, dest)}")
    return f"{', '.join(named)}: {message}" if named else message


def _recorded_arguments(args: argparse.Namespace) -> dict:
    return {k: v for k, v in vars(args).items() if not k.startswith("_")}


def check_samples(files: list[SampleFile], method, config, model_path: str,
                  question_as_decode: bool = False, split_flag: str = "--question_as_decode") -> None:
    """Each sample fits the model's window with its new tokens (with several questions: the context, the longest
    question and the new tokens), and the method can do what its settings say on what it prefills
    (Method.check_prompt, else an UnfitPrompt: a ratio budget below the window, a pooling kernel wider than the
    prompt): the whole prompt, or with question_as_decode (`split_flag`: the flag that asked for it) its context,
    which must leave a question part of at least one token; a sample with several questions prefills its prompt,
    the context."""
    window = getattr(config, "max_position_embeddings", None)
    for sample_file in files:
        for sample in sample_file.samples:
            name = sample.label or f"{sample_file.source or sample_file.name}: sample {sample.key}"
            asked = max((len(q.ids) for q in sample.questions), default=0) if sample.questions else 0
            if window and len(sample.prompt) + asked + sample.max_new_tokens > window:
                raise ValueError(f"{name} needs {len(sample.prompt) + asked} prompt + {sample.max_new_tokens} new "
                                 f"tokens, above the model's window: {model_path} has max_position_embeddings = "
                                 f"{window}")
            prefilled = len(sample.prompt)
            split = question_as_decode and not sample.questions
            if split:
                start = sample.question_start
                if start is None or not 0 < start < len(sample.prompt):
                    where = "no question part" if start is None else (
                        f"its question part at token {start} of {len(sample.prompt)}, which leaves "
                        f"{'no context' if start <= 0 else 'no question'}")
                    raise ValueError(f"{split_flag}: {name} has {where}; run it without {split_flag}")
                prefilled = start
            try:
                method.check_prompt(prefilled)
            except ValueError as e:
                what = f"{prefilled} context tokens" if split or sample.questions else f"{prefilled} tokens"
                raise UnfitPrompt(f"{name} ({what}): {e}") from None


def decode_pending(args, method, benchmark: Benchmark, files: list[SampleFile], out_dir: Path) -> None:
    """Decode every sample not yet in its predictions file, one appended row each, flushed as its batch ends;
    the model loads only when a sample is pending. Batches hold samples of one file with one max_new_tokens
    (see `batches`): a file's rows come in the order of its samples, or, where the benchmark batches by length
    and batches hold more than one sample, batch by batch, longest prompts first; rows are keyed, so a resumed
    run decodes exactly the samples missing."""
    from tqdm import tqdm

    from pyramidkv.runner.divergence import decode_scored, reference_store
    from pyramidkv.runner.results import ResultsWriter

    if args.shared_context or any(s.questions for f in files for s in f.samples):
        return decode_questions(args, method, benchmark, files, out_dir)
    total = sum(len(f.samples) for f in files)
    references = reference_store(args) if args.kl_vs_fullkv else None
    model = tokenizer = None
    started, done_now = time.perf_counter(), 0
    with tqdm(total=total, unit="sample", dynamic_ncols=True, desc=benchmark.name) as bar:
        for sample_file in files:
            with ResultsWriter(out_dir / sample_file.file_name, key=benchmark.key) as writer:
                pending = [s for s in sample_file.samples if s.key not in writer.done]
                bar.update(len(sample_file.samples) - len(pending))
                if not pending:
                    continue
                if model is None:
                    model, tokenizer = load_run_model(args, out_dir)
                bar.set_postfix_str(sample_file.name)
                for batch in batches(pending, args.eval_batch_size, benchmark.batch_by_length):
                    if benchmark.decode_sample is not None:
                        for sample in batch:
                            writer.append(benchmark.decode_sample(model, tokenizer, method, sample, sample_file, args))
                            bar.update(1)
                        done_now += len(batch)
                        continue
                    if args.kl_vs_fullkv:
                        for sample in batch:
                            output, fields = decode_scored(model, tokenizer, method, sample, sample_file, references,
                                                           args.decode_threads)
                            writer.append({**benchmark.prediction_row(sample, output), **fields})
                        bar.update(len(batch))
                        done_now += len(batch)
                        continue
                    outputs = decode_batch(model, tokenizer, method, batch, sample_file.stop_token_ids,
                                           sample_file.min_new_tokens, args.question_as_decode, args.decode_threads,
                                           args.prefill_chunk_size)
                    for sample, output in zip(batch, outputs):
                        writer.append(benchmark.prediction_row(sample, output))
                    bar.update(len(batch))
                    done_now += len(batch)
    elapsed = time.perf_counter() - started
    if done_now:
        print(f"{done_now} sample(s) in {elapsed:.1f} s ({60 * done_now / elapsed:.2f} samples/min, batch size "
              f"{args.eval_batch_size}); {total - done_now} already done")
    else:
        print(f"all {total} sample(s) already done; scoring only")


def decode_batch(model, tokenizer, method, batch: list[Sample], stop_token_ids: Optional[list[int]],
                 min_new_tokens: int, question_as_decode: bool, decode_threads: Optional[int] = None,
                 prefill_chunk_size: Optional[int] = None) -> list:
    """One batch of samples (one max_new_tokens) through generate(): the prompts whole, or with
    question_as_decode each context prefilled and its question part fed as decode steps; decode_threads:
    CPU threads of the decode steps (None: torch's setting); prefill_chunk_size: chunked prefill (None: off)."""
    from pyramidkv.generation import generate

    prompts, questions = [s.prompt for s in batch], None
    if question_as_decode:
        prompts = [s.prompt[:s.question_start] for s in batch]
        questions = [s.prompt[s.question_start:] for s in batch]
    return generate(model, tokenizer, prompts, method, max_new_tokens=batch[0].max_new_tokens,
                    stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens, questions=questions,
                    decode_threads=decode_threads, prefill_chunk_size=prefill_chunk_size)
