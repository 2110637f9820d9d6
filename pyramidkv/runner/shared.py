"""Several questions on one context in a run: under `--shared_context` each context is compressed once and its
questions are answered from it (generation/shared.py); a sample with several questions and no --shared_context
asks each inside its own prompt (context + question prefilled together, compression sees the question), so the
two protocols run on the same tokens. Either way one row per question, keyed `qid` = "{key}#{turn}", carrying the
sample's key and the question's `turn` (1 = the first question); a rerun answers only the questions missing
(multi_request and own prompts: just those, as the order never matters; multi_turn replays the conversation and
writes the missing turns)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from pyramidkv.components import check_output
from pyramidkv.runner.batching import batches, load_run_model

QID = "qid"


@dataclass
class Question:
    """One of a context's questions (`Sample.questions`): the token ids fed after the context, the follow-up form a
    later turn of multi_turn feeds (None: the same ids), and the fields its row carries (its references)."""

    ids: Sequence[int]
    followup: Optional[Sequence[int]] = None
    row: Optional[dict] = None

    @classmethod
    def of(cls, tokenizer, question: dict, row: dict) -> "Question":
        """From a generated question ({"question": text after the context, "followup": its later-turn text or
        absent}), tokenized alone without special tokens."""
        def ids(text: str) -> list[int]:
            return tokenizer(text, add_special_tokens=False).input_ids

        return cls(ids(question["question"]), ids(question["followup"]) if question.get("followup") else None, row)


def qid(key, turn: int) -> str:
    return f"{key}#{turn}"


def context_and_questions(sample) -> tuple[list[int], list[Question]]:
    """(the context's token ids, its questions): `Sample.questions` after `prompt`, or one question, the part of the
    prompt from `question_start` on."""
    if sample.questions:
        return list(sample.prompt), list(sample.questions)
    start = sample.question_start
    return list(sample.prompt[:start]), [Question(list(sample.prompt[start:]))]


def check_cache_file_flags(args) -> None:
    """--save_compressed / --load_compressed: under --shared_context, one context per batch, a usable folder."""
    for flag in ("save_compressed", "load_compressed"):
        folder = getattr(args, flag, None)
        if folder is None:
            continue
        if not args.shared_context:
            raise ValueError(f"--{flag} needs --shared_context (a compressed context is what it shares)")
        if getattr(args, "eval_batch_size", 1) != 1:
            raise ValueError(f"--{flag} stores one context per file: give --eval_batch_size 1, got "
                             f"{args.eval_batch_size}")
        if flag == "load_compressed" and not Path(folder).is_dir():
            raise ValueError(f"--load_compressed {folder}: no such folder")
        if Path(folder).exists() and not Path(folder).is_dir():
            raise ValueError(f"--{flag} {folder} is a file, not a folder")
        if flag == "save_compressed":   # /proc/nope passed, and failed once the model had loaded
            try:
                check_output(folder, folder=True)
            except ValueError as e:
                raise ValueError(f"--save_compressed: {e}") from None


def cache_configuration(benchmark, args, method) -> Path:
    """What made a saved cache, as a relative folder: the run folder's {model}_{budget}/{method label} (without the
    protocol's suffixes, on which a compressed context does not depend). Two configurations never share a file."""
    from pyramidkv.runner.labels import run_dir

    return run_dir("", benchmark.model_label(args), method)


def cache_path(folder: str, configuration: Path, sample_file, key) -> Path:
    """Where --save_compressed writes (and --load_compressed reads) a context's cache:
    DIR/{configuration}/{predictions file}/{key}.safetensors."""
    return Path(folder) / configuration / Path(sample_file.file_name).stem / f"{str(key).replace('/', '_')}.safetensors"


def check_cache_files(args, files, method, configuration: Path, made_on: dict) -> None:
    """Before the model loads (one line each; made_on: the model's identity known then, cache_file.
    identity_before_loading): the cache files --load_compressed would read are whole, unedited, of this method, model
    and context (its token ids' digest), and there is at least one; a file --save_compressed would replace holds a
    cache of this configuration (cache_file.check_replaceable). The weights fingerprint is checked as each loads."""
    load, save = getattr(args, "load_compressed", None), getattr(args, "save_compressed", None)
    if not (load or save):
        return
    from pyramidkv.generation.cache_file import (check_context, check_identity, check_replaceable, context_digest,
                                                 read_record)
    from pyramidkv.methods import method_spec

    spec, found = method_spec(method), 0
    for sample_file in files:
        for sample in sample_file.samples:
            context = context_and_questions(sample)[0]
            path = cache_path(load, configuration, sample_file, sample.key) if load else None
            if path is not None and path.is_file():
                found += 1
                record = read_record(path)[0]
                if record["method"] != spec:
                    raise ValueError(f"--load_compressed: {path} holds a cache of {record['method']!r}, not of this "
                                     f"run's {spec!r}")
                check_identity(path, record["model"], made_on, record.get("dtypes", ()))
                check_context(path, record, context)
            elif save:
                check_replaceable(cache_path(save, configuration, sample_file, sample.key), {
                    "method": spec, "model": made_on, "positions": {"context_sha256": context_digest([context])}})
    if load and not found:   # the flag would do nothing
        first = files[0]
        raise ValueError(f"--load_compressed {load} holds no cache file of this run's contexts (e.g. "
                         f"{cache_path(load, configuration, first, first.samples[0].key)}, as --save_compressed "
                         f"writes them)")


def _rows(benchmark, sample, context: list[int], turns: list[int], questions: list[Question], outputs) -> list[dict]:
    """The benchmark's prediction rows of a sample's answers, each with its question's fields, turn and qid; the
    shared protocol's also with the compressed context's bytes and the times."""
    rows = []
    for turn, question, out in zip(turns, questions, outputs):
        row = {benchmark.key: sample.key, "turn": turn, QID: qid(sample.key, turn)}
        row.update(benchmark.prediction_row(sample, out))
        row.update(benchmark.question_row(sample, question, out))
        row["context_tokens"] = len(context)
        if hasattr(out, "context_kv_bytes"):
            row.update(context_kv_bytes=out.context_kv_bytes, time_to_first_token=round(out.time_to_first_token, 6),
                       prefill_seconds=round(out.prefill_seconds, 6))
        rows.append(row)
    return rows


def decode_questions(args, method, benchmark, files, out_dir: Path) -> None:
    """Every question not yet in its predictions file, one appended row each (flushed as its batch ends)."""
    from tqdm import tqdm

    from pyramidkv.generation import generate
    from pyramidkv.generation.shared import answer_questions
    from pyramidkv.runner.results import ResultsWriter

    mode = args.shared_context
    configuration = cache_configuration(benchmark, args, method)
    total = sum(len(context_and_questions(s)[1]) for f in files for s in f.samples)
    model = tokenizer = None
    started, done_now = time.perf_counter(), 0
    with tqdm(total=total, unit="question", dynamic_ncols=True, desc=benchmark.name) as bar:
        for sample_file in files:
            with ResultsWriter(out_dir / sample_file.file_name, key=QID) as writer:
                work = []   # (sample, context, its questions, the turns missing)
                for sample in sample_file.samples:
                    context, questions = context_and_questions(sample)
                    missing = [t for t in range(1, len(questions) + 1) if qid(sample.key, t) not in writer.done]
                    bar.update(len(questions) - len(missing))
                    if missing:
                        work.append((sample, context, questions, missing))
                if not work:
                    continue
                if model is None:
                    model, tokenizer = load_run_model(args, out_dir)
                bar.set_postfix_str(sample_file.name)
                common = dict(stop_token_ids=sample_file.stop_token_ids, min_new_tokens=sample_file.min_new_tokens,
                              decode_threads=args.decode_threads)
                if mode is None:   # each question inside its own prompt
                    work = [(sample, context, [questions[t - 1]], [t], [t]) for sample, context, questions, missing
                            in work for t in missing]
                elif mode == "multi_request":   # only the missing ones: the order never matters
                    work = [(sample, context, [questions[t - 1] for t in missing], missing, missing)
                            for sample, context, questions, missing in work]
                else:                           # the whole conversation again, the missing turns written
                    work = [(sample, context, questions, list(range(1, len(questions) + 1)), missing)
                            for sample, context, questions, missing in work]
                for batch in batches([_Item(*w) for w in work], args.eval_batch_size, benchmark.batch_by_length):
                    max_new = batch[0].max_new_tokens
                    if mode is None:
                        outputs = generate(model, tokenizer, [i.context + list(i.asked[0].ids) for i in batch],
                                           method, max_new, **common)
                        per_item = [[out] for out in outputs]
                    else:
                        followups = [[list(q.followup or q.ids) for q in i.asked] for i in batch] \
                            if mode == "multi_turn" else None
                        files_kw, loaded = _cache_files(args, configuration, sample_file, batch, model, method)
                        per_item = answer_questions(model, tokenizer, [i.context for i in batch],
                                                    [[list(q.ids) for q in i.asked] for i in batch], method, max_new,
                                                    mode=mode, followups=followups, **common, **files_kw)
                    for item, outputs in zip(batch, per_item):
                        for row in _rows(benchmark, item.sample, item.context, item.turns, item.asked, outputs):
                            if mode is not None and (args.load_compressed or args.save_compressed):
                                row["compressed_cache"] = "loaded" if loaded else "compressed"
                            if row["turn"] in item.missing:
                                writer.append(row)
                        bar.update(len(item.missing))
                        done_now += len(item.missing)
    elapsed = time.perf_counter() - started
    print(f"{done_now} question(s) in {elapsed:.1f} s; {total - done_now} already done" if done_now else
          f"all {total} question(s) already done; scoring only")


def _cache_files(args, configuration: Path, sample_file, batch, model, method) -> tuple[dict, bool]:
    """answer_questions' arguments for --load_compressed / --save_compressed (one context per batch), and whether
    the context's cache was loaded (checked against the context's token ids)."""
    if not (args.load_compressed or args.save_compressed):
        return {}, False
    from pyramidkv.generation.cache_file import load_cache, save_cache

    key, context = batch[0].sample.key, batch[0].context
    if args.load_compressed and cache_path(args.load_compressed, configuration, sample_file, key).is_file():
        return {"compressed": load_cache(cache_path(args.load_compressed, configuration, sample_file, key), model,
                                         method, context=context)}, True
    if args.save_compressed:
        path = cache_path(args.save_compressed, configuration, sample_file, key)
        path.parent.mkdir(parents=True, exist_ok=True)
        return {"on_compressed": lambda cache: save_cache(cache, path, model, context=context)}, False
    return {}, False


class _Item:
    """A sample's pending work as `batches` sees it (prompt: the context; max_new_tokens, batch_group: the
    sample's): the questions asked, their turns, the turns whose rows are missing."""

    def __init__(self, sample, context: list[int], asked: list[Question], turns: list[int], missing: list[int]):
        self.sample, self.context, self.asked, self.turns, self.missing = sample, context, asked, turns, missing
        self.prompt, self.max_new_tokens, self.batch_group = context, sample.max_new_tokens, sample.batch_group
