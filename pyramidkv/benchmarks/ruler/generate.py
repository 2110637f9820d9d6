"""Build RULER samples that fit a target length under a model's tokenizer; cache and read RULER-format JSONL.

Sizing: for each sample, the haystack size is the largest one for which
    tokens(chat template(user turn: instruction + haystack + question) + answer prefix) + max_new_tokens <= length,
found by exponential then binary search over the task's haystack unit. The
result is checked, so a sample never exceeds the target; it falls short by
less than one haystack unit (a word, a sentence, a needle, a document).

Rows are the RULER format: {"index", "input", "outputs", "length", "task", "max_new_tokens"},
where "input" is the complete prompt (chat template and answer prefix included)
and "length" = prompt tokens + max_new_tokens, plus "question_start": the character
offset in "input" where the sample's haystack (`Rendered.context`) ends and its question
part begins (what --question_as_decode feeds as decode steps).

Several questions per context (`questions_per_context` K > 1, tasks that allow it): the row is question 1's
row plus "questions": K objects {"question", "followup", "outputs"}, question 1 first, where
input[:question_start] + question is that question's full single-question prompt and "followup" is the same
question as a later user turn (after an answer's end-of-turn token). The haystack size is the largest for
which the context with the longest question part fits the length.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from pyramidkv.benchmarks.prompting import chat_frame, followup_frame
from pyramidkv.benchmarks.ruler.tasks import (
    TASKS, Builder, Rendered, check_questions_per_context, get_task, make_builder,
)

# Bump whenever a sample's text or fields can change: cached samples of another version are regenerated.
# 4: rows record "question_start" (the text is that of version 3).
GENERATOR_VERSION = 4


# --------------------------------------------------------------------------------------------
# prompts
# --------------------------------------------------------------------------------------------

class PromptFormatter:
    """The full prompt of a sample: the task body as the only user turn of the tokenizer's chat template (no
    system turn, as in RULER's model templates, unless `system_prompt` is given), then the assistant turn opened
    with the task's answer prefix exactly as RULER writes it (leading space included).

    Without the chat template: BOS (when the model expects one) + body + answer prefix, RULER's "base" template.
    """

    def __init__(self, tokenizer, use_chat_template: bool = True, system_prompt: Optional[str] = None):
        self.tokenizer = tokenizer
        self.use_chat_template = bool(use_chat_template and getattr(tokenizer, "chat_template", None))
        if system_prompt is not None:
            if not system_prompt.strip():
                raise ValueError(f"--system_prompt {system_prompt!r} is empty; give a text, or leave the flag out "
                                 "for no system turn (RULER's default)")
            if not self.use_chat_template:
                raise ValueError("--system_prompt needs the chat template, but it is off (--no_chat_template, or "
                                 f"the tokenizer {type(tokenizer).__name__} has none)")
        self.system_prompt = system_prompt
        self._bos = ""
        self._head = self._tail = ""
        self._followup: Optional[tuple[str, str]] = None     # found on first use (templates without one still work)
        if self.use_chat_template:
            self._head, self._tail = self._user_turn_frame()
        elif tokenizer.bos_token_id is not None and tokenizer.bos_token:
            probe = tokenizer("a").input_ids
            if probe and probe[0] == tokenizer.bos_token_id:
                self._bos = tokenizer.bos_token  # the model expects a BOS: keep it, as text

    def _user_turn_frame(self) -> tuple[str, str]:
        """(text before the body, text after it) of the chat template's rendering, assistant turn opened; no
        system turn unless system_prompt is given."""
        return chat_frame(self.tokenizer, self.system_prompt)

    def __call__(self, body: str, answer_prefix: str) -> str:
        if self.use_chat_template:
            return self._head + body + self._tail + answer_prefix
        return self._bos + body + answer_prefix

    def followup(self, question: str, answer_prefix: str) -> str:
        """`question` as a later user turn: the chat template's text after an answer's end-of-turn token, the
        question, the end of the turn, the assistant header, the answer prefix. Without the chat template:
        a newline, the question, the answer prefix."""
        if not self.use_chat_template:
            return "\n" + question + answer_prefix
        if self._followup is None:
            self._followup = followup_frame(self.tokenizer)
        head, tail = self._followup
        return head + question + tail + answer_prefix

    def body_offset(self) -> int:
        """Where the body starts in a prompt (characters): after the chat template's head or the BOS."""
        return len(self._head if self.use_chat_template else self._bos)

    def count(self, text: str) -> int:
        """Tokens of a full prompt, exactly as generation tokenizes it (no added special tokens)."""
        return len(self.tokenizer(text, add_special_tokens=False).input_ids)

    def describe(self) -> dict:
        template = getattr(self.tokenizer, "chat_template", None) or ""
        if not isinstance(template, str):
            template = json.dumps(template, sort_keys=True)
        return {
            "chat_template": self.use_chat_template,
            "chat_template_sha1": hashlib.sha1(template.encode()).hexdigest()[:12] if self.use_chat_template else None,
            "system_prompt": self.system_prompt,
            "tokenizer_class": type(self.tokenizer).__name__,
            "vocab_size": len(self.tokenizer),
        }


# --------------------------------------------------------------------------------------------
# sizing
# --------------------------------------------------------------------------------------------

@dataclass
class Fitted:
    size: int
    rendered: Rendered
    prompt: str
    prompt_tokens: int


def fit(builder: Builder, measure: Callable[[Rendered], tuple[str, int]], prompt_budget: int,
        task: str, length: int) -> Fitted:
    """The largest haystack size whose prompt has at most `prompt_budget` tokens."""
    cache: dict[int, Fitted] = {}

    def at(size: int) -> Fitted:
        if size not in cache:
            rendered = builder.render(size)
            prompt, tokens = measure(rendered)
            cache[size] = Fitted(size, rendered, prompt, tokens)
        return cache[size]

    lo = builder.min_size
    if at(lo).prompt_tokens > prompt_budget:
        raise ValueError(f"context length {length} is too short for task {task}: its smallest prompt "
                         f"({lo} {builder.unit}) already has {at(lo).prompt_tokens} tokens, over the "
                         f"{prompt_budget} left after the tokens to generate")
    top = builder.max_size
    step = 1
    hi = None  # smallest size known not to fit (or past max_size)
    while True:
        probe = lo + step
        if top is not None and probe > top:
            if at(top).prompt_tokens <= prompt_budget:
                raise ValueError(f"task {task} cannot fill {length} tokens: all {top} {builder.unit} "
                                 f"make only {at(top).prompt_tokens} prompt tokens (of {prompt_budget})")
            hi = top
            break
        if at(probe).prompt_tokens <= prompt_budget:
            lo = probe
            step *= 2
        else:
            hi = probe
            break
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid).prompt_tokens <= prompt_budget:
            lo = mid
        else:
            hi = mid
    best = at(lo)
    assert best.prompt_tokens <= prompt_budget
    return best


def question_prompts(rendered: Rendered, formatter: PromptFormatter) -> list[str]:
    """The full single-question prompt of each of `rendered`'s questions (question 1 first)."""
    before = rendered.body[:context_end(rendered)]
    return [formatter(before + q.text, q.answer_prefix) for q in rendered.questions]


def fit_sample(task: str, length: int, index: int, formatter: PromptFormatter, seed: int = 42,
               squad_file: Optional[str] = None, hotpot_file: Optional[str] = None,
               questions_per_context: int = 1) -> Fitted:
    """The fitted render of sample `index`: with K > 1 questions, the largest haystack for which the context
    with the longest question part fits (`prompt` and `prompt_tokens` are then those of the longest). Every sample
    is built here: the one place generation checks K (check_questions_per_context; the runner checks its flag
    before)."""
    check_questions_per_context(task, questions_per_context)
    spec = get_task(task)
    max_new = spec.max_new_tokens
    if length <= max_new:
        raise ValueError(f"context length {length} must exceed the {max_new} tokens task {task} generates")
    builder = make_builder(spec, seed, length, index, squad_file=squad_file, hotpot_file=hotpot_file,
                           count_tokens=formatter.count, questions_per_context=questions_per_context)

    def measure(rendered: Rendered) -> tuple[str, int]:
        if questions_per_context == 1:
            prompt = formatter(rendered.body, rendered.answer_prefix)
            return prompt, formatter.count(prompt)
        return max(((p, formatter.count(p)) for p in question_prompts(rendered, formatter)), key=lambda m: m[1])

    return fit(builder, measure, length - max_new, task, length)


def generate_sample(task: str, length: int, index: int, formatter: PromptFormatter, seed: int = 42,
                    squad_file: Optional[str] = None, hotpot_file: Optional[str] = None,
                    questions_per_context: int = 1) -> dict:
    """One RULER-format row for sample `index` of `task` at `length` tokens; with `questions_per_context` K > 1
    also "questions" (K of them, question 1 first: see the module's docstring)."""
    best = fit_sample(task, length, index, formatter, seed, squad_file, hotpot_file, questions_per_context)
    max_new = get_task(task).max_new_tokens
    rendered = best.rendered
    question_start = formatter.body_offset() + context_end(rendered)
    if questions_per_context == 1:
        prompt, prompt_tokens = best.prompt, best.prompt_tokens
    else:
        prompts = question_prompts(rendered, formatter)
        prompt, prompt_tokens = prompts[0], formatter.count(prompts[0])
    row = {
        "index": index,
        "input": prompt,
        "outputs": list(rendered.outputs),
        "length": prompt_tokens + max_new,
        "task": task,
        "max_new_tokens": max_new,
        "question_start": question_start,
    }
    if questions_per_context > 1:
        head = prompt[:question_start]
        assert len(rendered.questions) == questions_per_context and rendered.outputs == rendered.questions[0].outputs
        row["questions"] = []
        for full, q in zip(prompts, rendered.questions):
            assert full.startswith(head), "a question's prompt does not share the context"
            row["questions"].append({"question": full[len(head):],
                                     "followup": formatter.followup(q.text.lstrip("\n"), q.answer_prefix),
                                     "outputs": list(q.outputs)})
        assert head + row["questions"][0]["question"] == prompt
    return row


def context_end(rendered: Rendered) -> int:
    """The character offset in `rendered.body` where its haystack ends (the question part begins there). The
    haystack's last occurrence: a worked example (vt, cwe) comes before the sample and has its own haystack."""
    start = rendered.body.rfind(rendered.context)
    if start < 0:
        raise ValueError("the rendered body does not hold its context verbatim")
    return start + len(rendered.context)


def generate_rows(task: str, length: int, num_samples: int, formatter: PromptFormatter, seed: int = 42,
                  squad_file: Optional[str] = None, hotpot_file: Optional[str] = None,
                  start: int = 0, questions_per_context: int = 1) -> list[dict]:
    return [generate_sample(task, length, i, formatter, seed, squad_file, hotpot_file, questions_per_context)
            for i in range(start, num_samples)]


# --------------------------------------------------------------------------------------------
# cache: {cache_dir}/{model}/{task}_{length}.jsonl (+ .meta.json); K > 1 questions: {task}_{length}_q{K}.jsonl
# --------------------------------------------------------------------------------------------

def _source_fingerprint(path: Optional[str]) -> Optional[dict]:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        return {"path": str(p), "missing": True}   # generation then fails with the task's own clear message
    stat = p.stat()
    return {"path": str(p.resolve()), "bytes": stat.st_size, "mtime": int(stat.st_mtime)}


def cache_paths(cache_dir: Path, model: str, task: str, length: int,
                questions_per_context: int = 1) -> tuple[Path, Path]:
    name = f"{task}_{length}" + (f"_q{questions_per_context}" if questions_per_context != 1 else "")
    base = Path(cache_dir) / model / name
    return base.with_suffix(".jsonl"), base.with_suffix(".meta.json")


def rows_to_jsonl(rows: Sequence[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def load_or_generate(task: str, length: int, num_samples: int, formatter: PromptFormatter, cache_dir: Path,
                     model: str, seed: int = 42, squad_file: Optional[str] = None,
                     hotpot_file: Optional[str] = None, questions_per_context: int = 1) -> list[dict]:
    """Rows 0..num_samples-1, from the cache when it was made with the same settings, else generated and cached.

    Samples are independent of each other, so a cache with more samples serves a smaller request and a
    larger request only generates the missing ones. K > 1 questions per context: a cache file of its own (any K but
    1 is a file of its own: only generation, which checks K in fit_sample, writes one).
    """
    from pyramidkv.runner.results import atomic_write_json, atomic_write_text, read_jsonl

    data_path, meta_path = cache_paths(cache_dir, model, task, length, questions_per_context)
    settings = {
        "generator_version": GENERATOR_VERSION, "task": task, "length": length, "seed": seed,
        "prompt": formatter.describe(),
        "source": _source_fingerprint(squad_file if task == "qa_1" else hotpot_file if task == "qa_2" else None),
    }
    if questions_per_context != 1:   # one question: the settings (and so the cache) of before
        settings["questions_per_context"] = questions_per_context
    rows: list[dict] = []
    if data_path.is_file() and meta_path.is_file():
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError:
            meta = None
        if meta and meta.get("settings") == settings:
            cached = read_jsonl(data_path)
            if len(cached) == meta.get("num_samples") and [r.get("index") for r in cached] == list(range(len(cached))):
                rows = cached
    if len(rows) >= num_samples:
        return rows[:num_samples]
    rows = rows + generate_rows(task, length, num_samples, formatter, seed, squad_file, hotpot_file, start=len(rows),
                                questions_per_context=questions_per_context)
    atomic_write_text(data_path, rows_to_jsonl(rows))
    atomic_write_json(meta_path, {"settings": settings, "num_samples": len(rows)})
    return rows


# --------------------------------------------------------------------------------------------
# RULER-format JSONL made elsewhere
# --------------------------------------------------------------------------------------------

_NAME_PATTERN = re.compile(r"^(?P<task>[a-z0-9_]+?)_(?P<length>\d+)(?:_q\d+)?$")


def read_data_file(path: Path, task: Optional[str] = None) -> list[dict]:
    """Read and check a RULER-format JSONL file: every row needs "input" (str) and "outputs" (list of str).

    "index" defaults to the row's position; an "answer_prefix" field (RULER keeps it apart from "input"
    in some versions) is appended to the input when the input does not already end with it;
    "max_new_tokens" defaults to the task's. "question_start" (rows written by this generator; RULER's own
    files have none) is kept when it is a character offset inside the input, else None. "questions" (rows with
    several questions per context), when present: a non-empty list of objects with "question" (str),
    "outputs" (non-empty list of str) and optionally "followup" (str), kept as they are.
    """
    from pyramidkv.runner.results import read_jsonl

    rows = read_jsonl(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    checked = []
    seen = set()
    for position, row in enumerate(rows):
        where = f"{path}: row {position + 1}"
        text = row.get("input")
        if not isinstance(text, str) or not text:
            raise ValueError(f"{where}: missing or empty \"input\" (RULER format: index, input, outputs, length)")
        outputs = row.get("outputs")
        if isinstance(outputs, str):
            outputs = [outputs]
        if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs):
            raise ValueError(f"{where}: \"outputs\" must be a non-empty list of strings")
        prefix = row.get("answer_prefix")
        if isinstance(prefix, str) and prefix.strip() and not text.rstrip().endswith(prefix.strip()):
            text = text + prefix
        index = row.get("index", position)
        if index in seen:
            raise ValueError(f"{where}: duplicate index {index!r}")
        seen.add(index)
        row_task = row.get("task", task)
        max_new = row.get("max_new_tokens")
        if max_new is None:
            if row_task not in TASKS:
                raise ValueError(f"{where}: no \"max_new_tokens\" and no known task to take it from")
            max_new = TASKS[row_task].max_new_tokens
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"{where}: \"max_new_tokens\" must be a positive integer, got {max_new!r}")
        question_start = row.get("question_start")
        if question_start is not None and (type(question_start) is not int or not 0 < question_start < len(text)):
            raise ValueError(f"{where}: \"question_start\" must be a character offset inside \"input\" "
                             f"(1..{len(text) - 1}), got {question_start!r}")
        out = {"index": index, "input": text, "outputs": outputs, "length": row.get("length"),
               "task": row_task, "max_new_tokens": max_new, "question_start": question_start}
        if "questions" in row:
            out["questions"] = _checked_questions(row["questions"], where)
        checked.append(out)
    return checked


def _checked_questions(questions, where: str) -> list[dict]:
    """The "questions" field of a data row, checked: ValueError naming the row and the field."""
    if not isinstance(questions, list) or not questions:
        raise ValueError(f"{where}: \"questions\" must be a non-empty list of objects with \"question\" and "
                         f"\"outputs\", got {type(questions).__name__}")
    checked = []
    for k, q in enumerate(questions):
        field = f"{where}: \"questions\"[{k}]"
        if not isinstance(q, dict):
            raise ValueError(f"{field} must be an object with \"question\" and \"outputs\", got {type(q).__name__}")
        unknown = sorted(set(q) - {"question", "followup", "outputs"})
        if unknown:
            raise ValueError(f"{field} has unknown fields {unknown}; allowed: question, followup, outputs")
        for name in ("question", "followup"):
            if (name in q or name == "question") and (not isinstance(q.get(name), str) or not q.get(name)):
                raise ValueError(f"{field}: \"{name}\" must be a non-empty string, got {q.get(name)!r}")
        outputs = q.get("outputs")
        if not isinstance(outputs, list) or not outputs or not all(isinstance(o, str) for o in outputs):
            raise ValueError(f"{field}: \"outputs\" must be a non-empty list of strings, got {outputs!r}")
        checked.append(dict(q))
    return checked


def infer_task_length(path: Path, context_lengths: Optional[Sequence[int]] = None) -> tuple[str, int]:
    """(task, target length) of a data file from its path:
    `{task}_{length}.jsonl` (this project's cache), or `.../{length}/data/{task}/validation.jsonl` (RULER's layout),
    or `.../{task}/validation.jsonl` with a single --context_lengths value.
    """
    path = Path(path)
    m = _NAME_PATTERN.match(path.stem)
    if m and m.group("task") in TASKS:
        return m.group("task"), int(m.group("length"))
    parent = path.parent.name
    if parent in TASKS:
        grand = path.parent.parent
        if grand.name == "data" and grand.parent.name.isdigit():
            return parent, int(grand.parent.name)
        if context_lengths and len(context_lengths) == 1:
            return parent, int(context_lengths[0])
        raise ValueError(f"{path}: cannot tell its target length; pass exactly one --context_lengths value")
    raise ValueError(f"{path}: cannot tell the task and length from the path; name it {{task}}_{{length}}.jsonl "
                     f"(task one of {', '.join(TASKS)}) or use RULER's {{length}}/data/{{task}}/validation.jsonl")


def find_in_data_dir(data_dir: Path, task: str, length: int, single_length: bool) -> Path:
    data_dir = Path(data_dir)
    candidates = [data_dir / f"{task}_{length}.jsonl", data_dir / str(length) / "data" / task / "validation.jsonl"]
    if single_length:
        candidates.append(data_dir / task / "validation.jsonl")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no data for {task} at {length} tokens in {data_dir}; looked for: "
                            + ", ".join(str(c) for c in candidates))
