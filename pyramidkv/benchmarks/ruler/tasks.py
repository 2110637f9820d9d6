"""The RULER tasks: what each one asks, and how one sample is laid out for a given haystack size.

Every task is a `TaskSpec` (name, family, options, tokens to generate, metric).
For one sample, `make_builder` draws everything that does not depend on the
haystack size (keys, values, essay depths, chains, word choices) from a
per-sample random generator; `builder.render(size)` then lays the sample out
with `size` haystack units, drawing what depends on the size (line positions,
list order) from a generator seeded with the size. The generator (`generate.py`)
binary-searches the size so the prompt fits the target length. A render is a
pure function of (seed, task, target length, sample index, size).

The text (instructions, questions, answer prefixes, needles, variable
statements, demonstrations) is RULER's (NVIDIA/RULER, scripts/data/synthetic);
docs/ruler.md lists where this generator differs on purpose.

Haystack units: essay words (essay haystacks), noise sentences (noise haystack,
variable tracking), distractor needles (needle haystack), uncommon words (cwe),
coded words in the zeta sample (fwe), distractor documents (qa), distractor pairs (kv_retrieval).

Several questions per context (`questions_per_context` K > 1, docs/ruler.md): the tasks whose context can
answer K separate questions render them all (`Rendered.questions`, question 1 first); the context and the
text before it are the same for every question. `TaskSpec.max_questions` says how many a task can pose.
kv_retrieval is not a RULER task: SCBench's key-value retrieval with InfiniteBench's prompt text.
"""

from __future__ import annotations

import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from pyramidkv.benchmarks.ruler import resources

# 40 needle depths (percent of the essay), 0..100 evenly spaced and rounded, as in RULER (essay haystacks only).
DEPTHS = tuple(int(round(i * 100 / 39)) for i in range(40))

NEEDLE = "One of the special magic {kind} for {key} is: {value}."

# What the value type is called in the prompt, plural and singular.
VALUE_NAMES = {"numbers": ("numbers", "number"), "words": ("words", "word"), "uuids": ("uuids", "uuid")}


@dataclass(frozen=True)
class TaskSpec:
    name: str
    family: str                 # niah | vt | cwe | fwe | qa | kv
    max_new_tokens: int         # RULER's tokens_to_generate
    metric: str                 # string_match_all | string_match_part
    options: dict = field(default_factory=dict)
    max_questions: int = 1      # questions one context can pose (questions_per_context at most)


# The most questions per context where the task sets no count of its own (distractor needles, chains, pairs).
MAX_QUESTIONS = 10


def _niah(name, haystack, key, value, keys=1, values=1, queries=1, max_questions=1) -> TaskSpec:
    return TaskSpec(name, "niah", 128, "string_match_all",
                    {"haystack": haystack, "key": key, "value": value,
                     "num_keys": keys, "num_values": values, "num_queries": queries}, max_questions)


TASKS: dict[str, TaskSpec] = {spec.name: spec for spec in (
    _niah("niah_single_1", "noise", "words", "numbers"),
    _niah("niah_single_2", "essay", "words", "numbers"),
    _niah("niah_single_3", "essay", "words", "uuids"),
    _niah("niah_multikey_1", "essay", "words", "numbers", keys=4, max_questions=4),          # one per key
    _niah("niah_multikey_2", "needle", "words", "numbers", max_questions=MAX_QUESTIONS),    # + distractors
    _niah("niah_multikey_3", "needle", "uuids", "uuids", max_questions=MAX_QUESTIONS),
    _niah("niah_multivalue", "essay", "words", "numbers", values=4),                        # one key
    _niah("niah_multiquery", "essay", "words", "numbers", keys=4, queries=4, max_questions=4),  # one per key
    TaskSpec("vt", "vt", 30, "string_match_all", {"num_chains": 1, "num_hops": 4}, MAX_QUESTIONS),  # per chain
    TaskSpec("cwe", "cwe", 120, "string_match_all", {"freq_cw": 30, "freq_ucw": 3, "num_cw": 10}),
    TaskSpec("fwe", "fwe", 50, "string_match_all", {"alpha": 2.0, "coded_wordlen": 6, "num_answers": 3}),
    TaskSpec("qa_1", "qa", 32, "string_match_part", {"dataset": "squad"}),
    TaskSpec("qa_2", "qa", 32, "string_match_part", {"dataset": "hotpotqa"}),
    # SCBench's key-value retrieval (not RULER's): InfiniteBench's kv_retrieval prompt and 50 tokens to generate.
    TaskSpec("kv_retrieval", "kv", 50, "string_match_all", {}, MAX_QUESTIONS),
)}

# The 11 RULER tasks generated from installed packages alone (`--tasks all`).
OFFLINE_TASKS = tuple(name for name, spec in TASKS.items() if spec.family not in ("qa", "kv"))
QA_TASKS = ("qa_1", "qa_2")
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3")


def get_task(name: str) -> TaskSpec:
    if name not in TASKS:
        raise ValueError(f"unknown RULER task {name!r}; choose from: {', '.join(TASKS)} (or 'all' for the "
                         f"{len(OFFLINE_TASKS)} offline tasks)")
    return TASKS[name]


def check_questions_per_context(task: str, questions_per_context) -> None:
    """ValueError (one line) unless `task` can pose `questions_per_context` questions about one context."""
    spec = get_task(task)
    k = questions_per_context
    if type(k) is not int or k < 1:
        raise ValueError(f"questions_per_context must be a whole number of at least 1, got {k!r}")
    if k > spec.max_questions:
        several = ", ".join(f"{s.name} (up to {s.max_questions})" for s in TASKS.values() if s.max_questions > 1)
        raise ValueError(f"task {task} cannot pose {k} questions per context (at most {spec.max_questions}); "
                         f"tasks that pose several: {several}")


@dataclass
class Question:
    """One question about a rendered context: the body's text after the haystack, the answer prefix, the answers."""
    text: str                   # RULER's text after the haystack for this question, leading newline(s) included
    answer_prefix: str
    outputs: list[str]


@dataclass
class Rendered:
    body: str                   # the user message: instruction, haystack, question
    answer_prefix: str          # the start of the answer, put after the assistant turn opens; RULER's text,
                                # leading space (and vt's trailing space) included
    outputs: list[str]          # the references
    context: str                # the haystack part of `body` (the scored sample's own, no demonstration)
    questions: list[Question] = field(default_factory=list)   # K-question builders: all K, question 1 first


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------

def _random_value(kind: str, rng: random.Random) -> str:
    if kind == "numbers":
        return str(rng.randint(10 ** 6, 10 ** 7 - 1))
    if kind == "words":
        return f"{rng.choice(resources.adjectives())}-{rng.choice(resources.nouns())}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}; use numbers, words or uuids")


class _Fresh:
    """Random keys/values that never repeat within one sample."""

    def __init__(self, rng: random.Random, seen: Optional[set] = None):
        self.rng = rng
        self.seen = set() if seen is None else seen

    def __call__(self, kind: str) -> str:
        for _ in range(10_000):
            value = _random_value(kind, self.rng)
            if value not in self.seen:
                self.seen.add(value)
                return value
        raise RuntimeError(f"could not draw a new distinct {kind} value")


def _insert_at(units: list[str], items: list[str], positions: list[int]) -> list[str]:
    """Put `items` (in order) before the units at the sorted `positions`; len(units) = after the last unit."""
    out: list[str] = []
    j = 0
    for i, unit in enumerate(units):
        while j < len(items) and positions[j] <= i:
            out.append(items[j])
            j += 1
        out.append(unit)
    out.extend(items[j:])
    return out


def _insert(units: list[str], items: list[str], fractions: list[float]) -> list[str]:
    """Put `items` (in order) before the unit at position int(len(units) * fraction); 1.0 = the end."""
    return _insert_at(units, items, [min(len(units), int(len(units) * f)) for f in fractions])


def _insert_before_lines(lines: list[str], items: list[str], rng: random.Random) -> list[str]:
    """Put `items` (in order) before distinct lines drawn uniformly at random, as RULER does in line haystacks:
    never after the last line, never two items without a line between them."""
    if len(items) > len(lines):
        raise ValueError(f"{len(items)} insertions need at least {len(items)} haystack lines, got {len(lines)}")
    positions = sorted(rng.sample(range(len(lines)), len(items)))
    return _insert_at(lines, items, positions)


def _noise_lines(num_sentences: int) -> list[str]:
    """`num_sentences` noise sentences, five (one full noise block) per line; the last line may be partial."""
    full, rest = divmod(num_sentences, len(resources.NOISE_SENTENCES))
    lines = [resources.NOISE] * full
    if rest:
        lines.append(" ".join(resources.NOISE_SENTENCES[:rest]))
    return lines


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _essay_sentences(num_words: int) -> list[str]:
    """The first `num_words` essay words (cycling through the essays if needed), split into sentences."""
    words = resources.essay_words()
    if num_words <= 0:
        return []
    if num_words <= len(words):
        text = " ".join(words[:num_words])
    else:
        text = " ".join(words[i % len(words)] for i in range(num_words))
    return [s for s in _SENTENCE_END.split(text) if s]


def _sub_rng(*parts) -> random.Random:
    """A generator seeded from a string: stable across runs and Python versions (str seeds hash with SHA-512)."""
    return random.Random(":".join(str(p) for p in parts))


def _join_queries(keys: list[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


# --------------------------------------------------------------------------------------------
# builders
# --------------------------------------------------------------------------------------------

class Builder:
    """One sample of one task; `render(size)` for size in [min_size, max_size] (None = unbounded)."""

    min_size: int = 0
    max_size: Optional[int] = None
    unit: str = "unit"

    def render(self, size: int) -> Rendered:
        raise NotImplementedError


class NiahBuilder(Builder):
    """Needles in essays (at RULER's depth grid, between sentences), in noise lines or among distractor needles
    (before distinct lines drawn at random, as RULER).

    `questions` > 1: question 1 is the task's own; the others ask one key each, the singular form of RULER's
    question: niah_multikey_1 the other inserted keys (in an order drawn once), niah_multiquery its queried
    keys one by one (question 1 too), niah_multikey_2/3 distractor needles at positions drawn per size (the
    haystack is the same as with one question). Everything drawn for one question is drawn as before.
    """

    def __init__(self, spec: TaskSpec, rng: random.Random, seed_key: str, questions: int = 1):
        o = spec.options
        self.haystack = o["haystack"]
        self.value_kind = o["value"]
        self.num_values = o["num_values"]
        self.seed_key = seed_key
        self.num_questions = questions
        num_keys = max(o["num_keys"], o["num_queries"])
        fresh = _Fresh(rng)
        keys = [fresh(o["key"]) for _ in range(num_keys)]
        values = [[fresh(o["value"]) for _ in range(o["num_values"])] for _ in keys]
        needles = [NEEDLE.format(kind=o["value"], key=k, value=v) for k, vs in zip(keys, values) for v in vs]
        rng.shuffle(needles)
        self.needles = needles
        self.fractions = [d / 100 for d in sorted(rng.sample(DEPTHS, len(needles)))]
        queried = rng.sample(range(num_keys), o["num_queries"])
        # (keys asked, their values) per question, question 1 first; needle haystacks add distractors per size.
        self.asks = [([keys[i] for i in queried], [v for i in queried for v in values[i]])]
        if questions > 1 and o["num_queries"] > 1:
            self.asks = [([keys[i]], list(values[i])) for i in queried[:questions]]
        elif questions > 1 and self.haystack != "needle":
            others = [i for i in range(num_keys) if i not in queried]
            _sub_rng(seed_key, "questions").shuffle(others)
            self.asks += [([keys[i]], list(values[i])) for i in others[:questions - 1]]
        self.singular = o["num_queries"] * o["num_values"] == 1
        self.unit = {"essay": "essay words", "noise": "noise sentences", "needle": "distractor needles"}[self.haystack]
        if self.haystack == "noise":
            self.min_size = len(resources.NOISE_SENTENCES) * len(needles)   # one line per needle
        elif self.haystack == "needle":
            self.min_size = max(len(needles), questions - 1)   # the asked distractors are in every haystack
            # Distractor needles: same shape, other keys and values; drawn lazily from their own generator so
            # distractor i is the same whatever sizes were rendered before.
            self._distractor_fresh = _Fresh(random.Random(rng.getrandbits(64)), set(fresh.seen))
            self._key_kind = o["key"]
            self._distractors: list[tuple[str, str]] = []
        else:
            resources.essay_words()  # fail early with a clear message if the essays are missing

    def _distractor_pairs(self, n: int) -> list[tuple[str, str]]:
        while len(self._distractors) < n:
            key = self._distractor_fresh(self._key_kind)
            self._distractors.append((key, self._distractor_fresh(self.value_kind)))
        return self._distractors[:n]

    def _question(self, keys: list[str], outputs: list[str]) -> Question:
        plural, single = VALUE_NAMES[self.value_kind]
        query = _join_queries(keys)
        # RULER's template; for one answer it swaps Some->A, are all->is, are->is and drops the plural "s".
        if len(keys) * self.num_values == 1:
            return Question(f"\nWhat is the special magic {single} for {query} mentioned in the provided text?",
                            f" The special magic {single} for {query} mentioned in the provided text is", outputs)
        return Question(f"\nWhat are all the special magic {plural} for {query} mentioned in the provided text?",
                        f" The special magic {plural} for {query} mentioned in the provided text are", outputs)

    def render(self, size: int) -> Rendered:
        asks = list(self.asks)
        if self.haystack == "essay":
            context = " ".join(_insert(_essay_sentences(size), self.needles, self.fractions))
        else:
            if self.haystack == "noise":
                lines = _noise_lines(size)
            else:
                pairs = self._distractor_pairs(size)
                lines = [NEEDLE.format(kind=self.value_kind, key=k, value=v) for k, v in pairs]
                if self.num_questions > 1:
                    asked = _sub_rng(self.seed_key, "asked distractors", size).sample(range(size),
                                                                                       self.num_questions - 1)
                    asks += [([pairs[i][0]], [pairs[i][1]]) for i in asked]
            context = "\n".join(_insert_before_lines(lines, self.needles, _sub_rng(self.seed_key, "lines", size)))
        plural, single = VALUE_NAMES[self.value_kind]
        if self.singular:
            intro = (f"A special magic {single} is hidden within the following text. Make sure to memorize it. "
                     f"I will quiz you about the {single} afterwards.\n")
        else:
            intro = (f"Some special magic {plural} are hidden within the following text. Make sure to memorize "
                     f"it. I will quiz you about the {plural} afterwards.\n")
        questions = [self._question(keys, outputs) for keys, outputs in asks]
        first = questions[0]
        return Rendered(intro + context + first.text, first.answer_prefix, list(first.outputs), context, questions)


class VariableTrackingBuilder(Builder):
    """One chain of `num_hops` assignments (VAR B = VAR A ...) from a 5-digit value, before distinct random
    noise lines (RULER's noise variant: `VAR ABCDE = 12345`, `VAR FGHIJ = VAR ABCDE ` with its trailing space).

    A worked example comes first, as in RULER: its own chain of 3-letter names and value, in as many noise
    lines as fit in DEMO_TOKENS tokens (question and answer prefix, without its answer), counted with the
    tokenizer under test.

    `questions` > 1: that many chains (RULER's num_chains), each its own value, one question per chain (question
    1 the first chain's, drawn as with one); the statements of all chains go before distinct random lines, each
    chain in its order, the chains interleaved at random. The worked example keeps one chain.
    """

    unit = "noise sentences"
    DEMO_TOKENS = 500
    DEMO_MIN_LINES = 5          # RULER's smallest step for the example

    def __init__(self, spec: TaskSpec, rng: random.Random, seed_key: str,
                 count_tokens: Optional[Callable[[str], int]], questions: int = 1):
        if count_tokens is None:
            raise ValueError("task vt needs the tokenizer's token counter to size its worked example "
                             "(make_builder(..., count_tokens=formatter.count))")
        hops = spec.options["num_hops"]
        if spec.options["num_chains"] != 1:
            raise ValueError(f"vt supports num_chains 1 only, got {spec.options['num_chains']}")
        self.seed_key = seed_key
        names = set()

        def chain(name_len: int, avoid=()):
            chosen = []
            while len(chosen) < hops + 1:
                name = "".join(rng.choice(string.ascii_uppercase) for _ in range(name_len))
                if name not in names:
                    names.add(name)
                    chosen.append(name)
            value = str(rng.randint(10000, 99999))
            while value in avoid:
                value = str(rng.randint(10000, 99999))
            statements = [f"VAR {chosen[0]} = {value}"]
            statements += [f"VAR {chosen[j + 1]} = VAR {chosen[j]} " for j in range(hops)]
            return chosen, value, statements

        demo_vars, demo_value, demo_statements = chain(3)
        self.chains = [chain(5)]
        while len(self.chains) < questions:
            self.chains.append(chain(5, {demo_value} | {value for _, value, _ in self.chains}))
        self.variables, self.value, self.statements = self.chains[0]
        # All chains' statements, each chain in order, chains interleaved (one chain: its statements).
        order = [c for c, (_, _, statements) in enumerate(self.chains) for _ in statements]
        if questions > 1:
            _sub_rng(seed_key, "chain order").shuffle(order)
        pending = [list(statements) for _, _, statements in self.chains]
        self.all_statements = [pending[c].pop(0) for c in order]
        self.min_size = len(resources.NOISE_SENTENCES) * len(self.all_statements)

        def demo_text(num_lines: int) -> str:
            lines = _insert_before_lines([resources.NOISE] * num_lines, demo_statements,
                                         _sub_rng(seed_key, "demo lines", num_lines))
            body, prefix = self._question("\n".join(lines), demo_value, len(demo_vars))
            return body + prefix

        # The largest example within DEMO_TOKENS (RULER sizes its example at 500 tokens the same way).
        lo, hi = self.DEMO_MIN_LINES, self.DEMO_MIN_LINES * 2
        while count_tokens(demo_text(hi)) <= self.DEMO_TOKENS:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if count_tokens(demo_text(mid)) <= self.DEMO_TOKENS else (lo, mid)
        self.demo = f"{demo_text(lo)} {' '.join(demo_vars)}\n\n"

    INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"

    @staticmethod
    def _asked(value: str, variables: list[str]) -> Question:
        return Question(f"\nQuestion: Find all variables that are assigned the value {value} in the text above.",
                        f" Answer: According to the chain(s) of variable assignment in the text above, "
                        f"{len(variables)} variables are assigned the value {value}, they are: ", list(variables))

    @classmethod
    def _question(cls, context: str, value: str, count: int) -> tuple[str, str]:
        asked = cls._asked(value, ["?"] * count)
        return cls.INTRO + context + asked.text, asked.answer_prefix

    def render(self, size: int) -> Rendered:
        lines = _insert_before_lines(_noise_lines(size), self.all_statements, _sub_rng(self.seed_key, "lines", size))
        context = "\n".join(lines)
        questions = [self._asked(value, variables) for variables, value, _ in self.chains]
        first = questions[0]
        return Rendered(self.demo + self.INTRO + context + first.text, first.answer_prefix, list(first.outputs),
                        context, questions)


class CommonWordsBuilder(Builder):
    """A numbered list: `num_cw` common words `freq_cw` times each, uncommon words `freq_ucw` times each.

    The binary search varies the number of uncommon words. Below 4096 tokens the list cannot hold
    10 words x 30, so (as RULER does) short contexts use 6 vs 1 repetitions and a smaller demonstration.
    The demonstration is RULER's: question, answer prefix and answer on one line, then the task.
    """

    unit = "uncommon words"

    def __init__(self, spec: TaskSpec, rng: random.Random, context_length: int, seed_key: str):
        o = spec.options
        self.num_cw = o["num_cw"]
        if context_length < 4096:
            self.freq_cw, self.freq_ucw = 6, 1
            demo_words, demo_cw, demo_ucw = 20, 3, 1
        else:
            self.freq_cw, self.freq_ucw = o["freq_cw"], o["freq_ucw"]
            demo_words, demo_cw, demo_ucw = 40, 10, 3
        vocab = list(resources.common_words_vocabulary())
        rng.shuffle(vocab)
        self.common = vocab[:self.num_cw]
        demo = vocab[len(vocab) - demo_words:]        # the demonstration's words never occur in the sample
        self.uncommon_pool = vocab[self.num_cw:len(vocab) - demo_words]
        self.max_size = len(self.uncommon_pool)
        self.seed_key = seed_key
        demo_list = demo[:self.num_cw] * demo_cw + demo[self.num_cw:] * demo_ucw
        rng.shuffle(demo_list)
        demo_body, prefix = self._question(self._numbered(demo_list))
        self.demo = f"{demo_body}{prefix} {self._numbered(demo[:self.num_cw])}\n"

    @staticmethod
    def _numbered(words: list[str]) -> str:
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))

    def _question(self, context: str) -> tuple[str, str]:
        body = ("Below is a numbered list of words. In these words, some appear more often than others. "
                f"Memorize the ones that appear most often.\n{context}\n"
                f"Question: What are the {self.num_cw} most common words in the above list?")
        prefix = f" Answer: The top {self.num_cw} words that appear most often in the list are:"
        return body, prefix

    def render(self, size: int) -> Rendered:
        items = self.common * self.freq_cw + self.uncommon_pool[:size] * self.freq_ucw
        _sub_rng(self.seed_key, "order", size).shuffle(items)
        context = self._numbered(items)
        body, prefix = self._question(context)
        return Rendered(self.demo + body, prefix, list(self.common), context)


def zeta(alpha: float) -> float:
    """Riemann zeta(alpha) for alpha > 1 (partial sum + Euler-Maclaurin tail)."""
    if alpha <= 1:
        raise ValueError(f"zeta needs alpha > 1, got {alpha}")
    if alpha == 2:
        return math.pi ** 2 / 6
    n = 1000
    head = sum(k ** -alpha for k in range(1, n))
    tail = n ** (1 - alpha) / (alpha - 1) + 0.5 * n ** -alpha + alpha * n ** (-alpha - 1) / 12
    return head + tail


class FrequentWordsBuilder(Builder):
    """Coded words (random 6-letter strings) with counts from a zeta(alpha) law: the word of rank k appears
    floor(N * k^-alpha / zeta(alpha)) times. Rank 1 is the noise token; the answer is ranks 2-4.
    As in RULER: the noise token in the text is '...' while the instruction says '....', and the vocabulary
    has (target length - tokens to generate) // 50 words. The binary search varies N.
    """

    unit = "zeta sample size N"
    NOISE_TOKEN = "..."                 # in the coded text
    INSTRUCTION_NOISE_TOKEN = "...."    # what the question tells the model to ignore

    def __init__(self, spec: TaskSpec, rng: random.Random, context_length: int, seed_key: str):
        o = spec.options
        self.alpha = float(o["alpha"])
        self.num_answers = o["num_answers"]
        vocab_size = max((context_length - spec.max_new_tokens) // 50, self.num_answers + 3)
        coded = set()
        vocab = []
        while len(vocab) < vocab_size:
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(o["coded_wordlen"]))
            if word not in coded:
                coded.add(word)
                vocab.append(word)
        vocab[0] = self.NOISE_TOKEN
        self.vocab = vocab
        self.z = zeta(self.alpha)
        self.seed_key = seed_key
        # The smallest N whose top num_answers+1 coded ranks have distinct, non-zero counts (a unique answer).
        n = 1
        while not self._answer_is_unique(n):
            n += 1
        self.min_size = n

    def counts(self, n: int) -> list[int]:
        return [int(n * (k ** -self.alpha) / self.z) for k in range(1, len(self.vocab) + 1)]

    def _answer_is_unique(self, n: int) -> bool:
        c = self.counts(n)[1:self.num_answers + 2]
        if len(c) < self.num_answers + 1 or c[-1] == 0:
            return False
        return all(a > b for a, b in zip(c, c[1:]))

    def render(self, size: int) -> Rendered:
        words = [w for w, c in zip(self.vocab, self.counts(size)) for _ in range(c)]
        _sub_rng(self.seed_key, "order", size).shuffle(words)
        context = " ".join(words)
        body = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                f"frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please "
                f"ignore the dots '{self.INSTRUCTION_NOISE_TOKEN}'. What are the three most frequently appeared words "
                "in the above coded text?")
        prefix = " Answer: According to the coded text above, the three most frequently appeared words are:"
        return Rendered(body, prefix, self.vocab[1:1 + self.num_answers], context)


class KeyValueBuilder(Builder):
    """SCBench's key-value retrieval: a JSON object of uuid keys -> uuid values (InfiniteBench's kv_retrieval
    layout: `JSON data:\n{"k": "v", ...}`), one question per asked pair. The asked pairs are drawn first and
    sit at positions drawn per size among distractor pairs (drawn lazily, as the distractor needles)."""

    unit = "distractor pairs"
    INSTRUCTION = "Extract the value corresponding to the specified key in the JSON object below.\n\n"
    ANSWER_PREFIX = " The value associated with the specified key is: "

    def __init__(self, rng: random.Random, seed_key: str, questions: int = 1):
        fresh = _Fresh(rng)
        self.asked = [(fresh("uuids"), fresh("uuids")) for _ in range(questions)]
        self._fresh = _Fresh(random.Random(rng.getrandbits(64)), set(fresh.seen))
        self._distractors: list[tuple[str, str]] = []
        self.seed_key = seed_key

    def render(self, size: int) -> Rendered:
        while len(self._distractors) < size:
            key = self._fresh("uuids")
            self._distractors.append((key, self._fresh("uuids")))
        pairs = self._distractors[:size]
        rng = _sub_rng(self.seed_key, "pairs", size)
        positions = sorted(rng.sample(range(size + len(self.asked)), len(self.asked)))
        order = list(range(len(self.asked)))
        rng.shuffle(order)
        for position, i in zip(positions, order):      # ascending: each lands at its final position
            pairs.insert(position, self.asked[i])
        context = "JSON data:\n" + json.dumps(dict(pairs), ensure_ascii=False)
        questions = [Question(f'\n\nKey: "{key}"', self.ANSWER_PREFIX, [value]) for key, value in self.asked]
        first = questions[0]
        return Rendered(self.INSTRUCTION + context + first.text, first.answer_prefix, list(first.outputs), context,
                        questions)


# --------------------------------------------------------------------------------------------
# QA (user-supplied SQuAD v2 / HotpotQA files)
# --------------------------------------------------------------------------------------------

@dataclass
class QASource:
    path: str
    docs: list[str]
    questions: list[dict]       # {"question", "answers": [...], "gold": [doc indices]}


class _Documents:
    """Distinct documents in first-seen order; `add` returns a document's index."""

    def __init__(self):
        self.texts: list[str] = []
        self._index: dict[str, int] = {}

    def add(self, text: str) -> int:
        if text not in self._index:
            self._index[text] = len(self.texts)
            self.texts.append(text)
        return self._index[text]


def _bad_file(path, what: str, e: Exception) -> ValueError:
    return ValueError(f"{path} is not a {what} file ({type(e).__name__}: {e})")


@lru_cache(maxsize=4)
def load_squad(path: str) -> QASource:
    """SQuAD v2.0 json (e.g. dev-v2.0.json): every answerable question with its paragraph as gold document."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        docs = _Documents()
        questions = []
        for article in data["data"]:
            for paragraph in article["paragraphs"]:
                doc = docs.add(paragraph["context"])
                for qa in paragraph["qas"]:
                    if qa.get("is_impossible"):
                        continue
                    answers = list(dict.fromkeys(a["text"] for a in qa["answers"]))
                    if answers:
                        questions.append({"question": qa["question"], "answers": answers, "gold": [doc]})
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise _bad_file(path, "SQuAD v2 (json with data/paragraphs/qas)", e) from None
    if not questions:
        raise ValueError(f"{path}: no answerable SQuAD question found")
    return QASource(str(path), docs.texts, questions)


@lru_cache(maxsize=4)
def load_hotpotqa(path: str) -> QASource:
    """HotpotQA dev json (e.g. hotpot_dev_distractor_v1.json): the question's own paragraphs are its documents."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        docs = _Documents()
        questions = []
        for item in data:
            gold = [docs.add(f"{title}\n{''.join(sentences)}") for title, sentences in item["context"]]
            questions.append({"question": item["question"], "answers": [item["answer"]], "gold": gold})
    except FileNotFoundError:
        raise
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as e:
        raise _bad_file(path, "HotpotQA (json list with question/answer/context)", e) from None
    if not questions:
        raise ValueError(f"{path}: no HotpotQA question found")
    return QASource(str(path), docs.texts, questions)


class QABuilder(Builder):
    """The question's gold document(s) among distractor documents drawn from the whole file, shuffled."""

    unit = "distractor documents"

    def __init__(self, spec: TaskSpec, rng: random.Random, source: QASource, index: int, set_key: str,
                 seed_key: str):
        order = list(range(len(source.questions)))
        _sub_rng(set_key, "questions").shuffle(order)
        item = source.questions[order[index % len(order)]]
        self.question, self.answers = item["question"], item["answers"]
        self.gold = [source.docs[i] for i in item["gold"]]
        gold = set(item["gold"])
        others = [i for i in range(len(source.docs)) if i not in gold]
        rng.shuffle(others)
        self.distractors = [source.docs[i] for i in others]
        self.max_size = len(self.distractors)
        self.seed_key = seed_key

    def render(self, size: int) -> Rendered:
        docs = self.gold + self.distractors[:size]
        _sub_rng(self.seed_key, "order", size).shuffle(docs)
        context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(docs))
        instruction = ("Answer the question based on the given documents. Only give me the answer and do not "
                       "output any other words.")
        body = (f"{instruction}\n\nThe following are given documents.\n\n{context}\n\n{instruction}\n\n"
                f"Question: {self.question}")
        return Rendered(body, " Answer:", list(self.answers), context)


def make_builder(spec: TaskSpec, seed: int, context_length: int, index: int,
                 squad_file: Optional[str] = None, hotpot_file: Optional[str] = None,
                 count_tokens: Optional[Callable[[str], int]] = None, questions_per_context: int = 1) -> Builder:
    """The builder of sample `index` of `spec` at `context_length`; independent of the other samples.

    `count_tokens` (text -> tokens under the model's tokenizer) sizes vt's worked example; vt requires it.
    `questions_per_context` > 1: the renders carry that many questions (check_questions_per_context first:
    generate.fit_sample, which builds every generated sample, does).
    """
    seed_key = f"ruler:{seed}:{spec.name}:{context_length}:{index}"
    rng = random.Random(seed_key)
    if spec.family == "niah":
        return NiahBuilder(spec, rng, seed_key, questions_per_context)
    if spec.family == "vt":
        return VariableTrackingBuilder(spec, rng, seed_key, count_tokens, questions_per_context)
    if spec.family == "kv":
        return KeyValueBuilder(rng, seed_key, questions_per_context)
    if spec.family == "cwe":
        return CommonWordsBuilder(spec, rng, context_length, seed_key)
    if spec.family == "fwe":
        return FrequentWordsBuilder(spec, rng, context_length, seed_key)
    if spec.family == "qa":
        source = qa_source(spec, squad_file, hotpot_file)
        # Question order is shared by all samples of the set (no repeats until the file is used up).
        return QABuilder(spec, rng, source, index, f"ruler:{seed}:{spec.name}:{context_length}", seed_key)
    raise ValueError(f"unknown task family {spec.family!r}")


def qa_source(spec: TaskSpec, squad_file: Optional[str], hotpot_file: Optional[str]) -> QASource:
    if spec.options["dataset"] == "squad":
        if not squad_file:
            raise ValueError("qa_1 needs a SQuAD v2.0 json file, which no package ships: download dev-v2.0.json "
                             "(rajpurkar.github.io/SQuAD-explorer) and pass --squad_file PATH")
        if not Path(squad_file).is_file():
            raise FileNotFoundError(f"--squad_file {squad_file}: no such file")
        return load_squad(str(squad_file))
    if not hotpot_file:
        raise ValueError("qa_2 needs a HotpotQA dev json file, which no package ships: download "
                         "hotpot_dev_distractor_v1.json (hotpotqa.github.io) and pass --hotpot_file PATH")
    if not Path(hotpot_file).is_file():
        raise FileNotFoundError(f"--hotpot_file {hotpot_file}: no such file")
    return load_hotpotqa(str(hotpot_file))
