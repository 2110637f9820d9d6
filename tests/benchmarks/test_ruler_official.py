"""Our RULER samples are the official generator's (NVIDIA/RULER scripts/data/synthetic, latest: vt says "assigned") for the same draws.

The official text below is benchmark data, written out by hand from RULER's constants.py and generator
scripts; the official assembly (singular rewrite, example layout, answer-prefix split) is re-stated here
independently of pyramidkv. Each test reads the draws (keys, values, variables, words, haystack) back from
a sample we generate and checks the full prompt against the official text built from those draws.
"""

from __future__ import annotations

import re
from collections import Counter
import pytest

from pyramidkv.benchmarks.ruler.generate import PromptFormatter, generate_rows, generate_sample
from pyramidkv.benchmarks.ruler.tasks import OFFLINE_TASKS, TASKS, make_builder
from tests.helpers import ROOT

# --- official text (RULER scripts/data/synthetic/constants.py, niah.py, variable_tracking.py) -------------
NIAH_TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize "
                 "it. I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special "
                 "magic {type_needle_v} for {query} mentioned in the provided text?")
NIAH_ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
VT_TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
               "Question: Find all variables that are assigned the value {query} in the text above.")
VT_ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                    "are assigned the value {query}, they are: ")
CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. Memorize "
                "the ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the "
                "above list?")
CWE_ANSWER_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_ANSWER_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"

# SmolLM2's ChatML, user turn only (RULER's model templates have no system prompt).
CHAT_USER_OPEN = "<|im_start|>user\n"
CHAT_USER_CLOSE = "<|im_end|>\n<|im_start|>assistant\n"

NIAH_SETUP = {  # task: (haystack, key regex, value kind, value regex, num_keys, num_values, num_queries)
    "niah_single_1": ("noise", r"[a-z]+-[a-z]+", "numbers", r"\d{7}", 1, 1, 1),
    "niah_single_2": ("essay", r"[a-z]+-[a-z]+", "numbers", r"\d{7}", 1, 1, 1),
    "niah_single_3": ("essay", r"[a-z]+-[a-z]+", "uuids", r"[0-9a-f-]{36}", 1, 1, 1),
    "niah_multikey_1": ("essay", r"[a-z]+-[a-z]+", "numbers", r"\d{7}", 4, 1, 1),
    "niah_multikey_2": ("needle", r"[a-z]+-[a-z]+", "numbers", r"\d{7}", 1, 1, 1),
    "niah_multikey_3": ("needle", r"[0-9a-f-]{36}", "uuids", r"[0-9a-f-]{36}", 1, 1, 1),
    "niah_multivalue": ("essay", r"[a-z]+-[a-z]+", "numbers", r"\d{7}", 1, 4, 1),
    "niah_multiquery": ("essay", r"[a-z]+-[a-z]+", "numbers", r"\d{7}", 4, 1, 4),
}


def official_split(text: str, answer_prefix: str) -> tuple[str, str]:
    """RULER's split of input and answer prefix: at the last occurrence of the prefix's first 10 characters."""
    cut = text.rfind(answer_prefix[:10])
    return text[:cut], text[cut:]


def in_chat(text: str, answer_prefix: str) -> str:
    user, prefix = official_split(text, answer_prefix)
    return CHAT_USER_OPEN + user + CHAT_USER_CLOSE + prefix


def between(text: str, start: str, end: str, nth: int = 0) -> str:
    """The text between the nth `start` and the next `end`."""
    pos = -1
    for _ in range(nth + 1):
        pos = text.index(start, pos + 1)
    begin = pos + len(start)
    return text[begin:text.index(end, begin)]


def official_niah(context, query, type_needle_v, num_values, num_queries) -> str:
    template = NIAH_TEMPLATE + NIAH_ANSWER_PREFIX
    if num_queries * num_values == 1:
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        template = template.replace("answers", "answer")
        type_needle_v = type_needle_v[:-1]
    return in_chat(template.format(type_needle_v=type_needle_v, context=context, query=query), " The special")


def is_noise_line(line: str) -> bool:
    """A noise line: the five sentences (our last line may stop after fewer, see docs/ruler.md)."""
    return bool(line) and NOISE.startswith(line) and (line == NOISE or NOISE[len(line)] == " ")


@pytest.mark.parametrize("task", list(NIAH_SETUP))
def test_niah_sample_is_the_official_text(task, formatter):
    haystack, key_re, kind, value_re, num_keys, num_values, num_queries = NIAH_SETUP[task]
    row = generate_sample(task, 2048, 1, formatter, seed=42)
    text = row["input"]
    context = between(text, "afterwards.\n", "\nWhat ")
    needle_re = re.compile(re.escape(NEEDLE).replace(r"\{type_needle_v\}", kind)
                           .replace(r"\{key\}", f"({key_re})").replace(r"\{value\}", f"({value_re})"))
    needles = needle_re.findall(context)
    values_of: dict[str, list[str]] = {}
    for key, value in needles:
        values_of.setdefault(key, []).append(value)
    # The draws: queried keys in question order, read from the outputs.
    queries = list(dict.fromkeys(k for v in row["outputs"] for k, vs in values_of.items() if v in vs))
    assert len(queries) == num_queries
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    assert text == official_niah(context, query, kind, num_values, num_queries)
    # RULER's answers: the queried keys' values, key by key (a key's values in drawing order, not context order).
    assert sorted(row["outputs"]) == sorted(v for k in queries for v in values_of[k])
    assert [k for v in row["outputs"] for k, vs in values_of.items() if v in vs] == \
        [k for k in queries for _ in range(num_values)]
    assert all(len(values_of[k]) == num_values for k in queries)
    if haystack == "needle":
        lines = context.split("\n")
        assert all(needle_re.fullmatch(line) for line in lines) and len(lines) > 10   # distractors of one form
        assert lines[-1] != NEEDLE.format(type_needle_v=kind, key=queries[0], value=row["outputs"][0])
    else:
        assert len(needles) == max(num_keys, num_queries) * num_values
    if haystack == "noise":
        lines = context.split("\n")
        needle_lines = [i for i, line in enumerate(lines) if needle_re.fullmatch(line)]
        assert len(needle_lines) == len(needles) and max(needle_lines) < len(lines) - 1   # never after the last
        assert all(is_noise_line(line) for i, line in enumerate(lines) if i not in needle_lines)
    if haystack == "essay":
        for key, value in needles:   # a whole sentence between sentences
            assert re.search(r"(^|[.!?\"'] )" + re.escape(NEEDLE.format(type_needle_v=kind, key=key, value=value))
                             + r"( |$)", context)


VT_STATEMENT = re.compile(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+) |(\d{5}))")


def chain_of(context: str, name_len: int) -> tuple[str, list[str]]:
    """(value, variables in chain order) from a vt haystack, checking its lines are noise or statements."""
    lines = context.split("\n")
    statements = [VT_STATEMENT.fullmatch(line) for line in lines]
    assert all(m or is_noise_line(line) for m, line in zip(statements, lines))
    found = [m.groups() for m in statements if m]
    assert len(found) == 5 and found[0][2] is not None
    assert all(found[j + 1][1] == found[j][0] for j in range(4))
    assert all(len(name) == name_len for name, _, _ in found)
    positions = [i for i, m in enumerate(statements) if m]
    assert positions[-1] < len(lines) - 1 and all(b - a > 1 for a, b in zip(positions, positions[1:]))
    return found[0][2], [name for name, _, _ in found]


def test_vt_sample_is_the_official_text(formatter, tokenizer):
    row = generate_sample("vt", 2048, 0, formatter, seed=42)
    text = row["input"]
    demo_context = between(text, "following text.\n\n", "\nQuestion:")
    demo_value, demo_vars = chain_of(demo_context, 3)
    context = between(text, "following text.\n\n", "\nQuestion:", nth=1)
    value, variables = chain_of(context, 5)
    demo_input = (VT_TEMPLATE.format(context=demo_context, query=demo_value)
                  + VT_ANSWER_PREFIX.format(num_v=5, query=demo_value))
    # RULER: example input + " " + its answer + "\n", then "\n", then the task.
    official = (demo_input + " " + " ".join(demo_vars) + "\n" + "\n"
                + VT_TEMPLATE.format(context=context, query=value) + VT_ANSWER_PREFIX.format(num_v=5, query=value))
    assert text == in_chat(official, " Answer: According")
    assert row["outputs"] == variables
    # The example is sized on its own, to 500 tokens of the same tokenizer (question + answer prefix).
    assert 470 <= len(tokenizer(demo_input, add_special_tokens=False).input_ids) <= 500


def numbered(words):
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(words))


@pytest.mark.parametrize("length,freq", [(2048, (6, 1, 3, 1)), (4096, (30, 3, 10, 3))])
def test_cwe_sample_is_the_official_text(length, freq, formatter):
    row = generate_sample("cwe", length, 0, formatter, seed=42)
    text = row["input"]
    demo_context = between(text, "most often.\n", "\nQuestion:")
    demo_answer = between(text, "in the list are: ", "\n").split(" ")[1::2]
    context = between(text, "most often.\n", "\nQuestion:", nth=1)
    official = (CWE_TEMPLATE.format(context=demo_context) + CWE_ANSWER_PREFIX + " " + numbered(demo_answer) + "\n"
                + CWE_TEMPLATE.format(context=context) + CWE_ANSWER_PREFIX)
    assert text == in_chat(official, " Answer: The top")
    freq_cw, freq_ucw, demo_cw, demo_ucw = freq
    for ctx, answer, (common, rare) in ((context, row["outputs"], (freq_cw, freq_ucw)),
                                        (demo_context, demo_answer, (demo_cw, demo_ucw))):
        items = re.findall(r"(\d+)\. (\S+)", ctx)
        assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))
        counts = Counter(w for _, w in items)
        assert {w for w, c in counts.items() if c == common} == set(answer) and len(answer) == 10
        assert all(c == rare for w, c in counts.items() if w not in answer)


def test_fwe_sample_is_the_official_text(formatter):
    row = generate_sample("fwe", 2048, 0, formatter, seed=42)
    context = between(row["input"], "coded words. ", "\nQuestion:")
    assert row["input"] == in_chat(FWE_TEMPLATE.format(context=context) + FWE_ANSWER_PREFIX, " Answer: According")
    counts = Counter(context.split(" ")).most_common()
    assert counts[0][0] == "..."                                   # the noise token, three dots
    assert [w for w, _ in counts[1:4]] == row["outputs"] and counts[3][1] > counts[4][1]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w, _ in counts[1:])


def test_every_offline_task_is_checked():
    checked = set(NIAH_SETUP) | {"vt", "cwe", "fwe"}
    assert checked == set(OFFLINE_TASKS)


# --- the items, one by one ------------------------------------------------------------------------

@pytest.mark.parametrize("task", ["niah_multivalue", "niah_multiquery"])
def test_item4_plural_niah_says_memorize_it(task, formatter):
    text = generate_sample(task, 1024, 0, formatter)["input"]
    assert "are hidden within the following text. Make sure to memorize it. I will quiz you about the numbers" in text
    assert "memorize them" not in text


def test_item5_fwe_noise_token_and_vocabulary_size(formatter):
    row = generate_sample("fwe", 1024, 0, formatter)
    context = between(row["input"], "coded words. ", "\nQuestion:")
    assert "...." not in context.split(" ") and context.split(" ").count("...") > 10
    assert "Please ignore the dots '....'." in row["input"]
    # (L - 50) // 50 words: the noise token + coded words.
    assert len(make_builder(TASKS["fwe"], 42, 2048, 0).vocab) == (2048 - 50) // 50 == 39
    assert len(make_builder(TASKS["fwe"], 42, 4096, 0).vocab) == (4096 - 50) // 50 == 80


def test_item6_vt_statements_on_the_noise_haystack(formatter):
    row = generate_sample("vt", 1024, 0, formatter)
    lines = row["input"].split("\n")
    assert sum(bool(re.fullmatch(r"VAR [A-Z]{5} = \d{5}", line)) for line in lines) == 1
    assert sum(bool(re.fullmatch(r"VAR [A-Z]{5} = VAR [A-Z]{5} ", line)) for line in lines) == 4
    assert not re.search(r"VAR [A-Z]+ = (VAR [A-Z]+|\d+)\.", row["input"])   # the period form is the essay variant's


def test_item7_example_length_and_separators(formatter, tokenizer):
    vt = generate_sample("vt", 2048, 0, formatter)["input"]
    demo = vt[len(CHAT_USER_OPEN):vt.index("\n\nMemorize and track", 10)]
    demo_input = demo[:demo.rindex("they are: ") + len("they are: ")]
    assert 470 <= len(tokenizer(demo_input, add_special_tokens=False).input_ids) <= 500
    assert re.search(r"in the text above\. Answer: According to the chain\(s\) of variable assignment in the text "
                     r"above, 5 variables are assigned the value \d{5}, they are:  [A-Z]{3}( [A-Z]{3}){4}\n\n"
                     r"Memorize and track", vt)
    cwe = generate_sample("cwe", 1024, 0, formatter)["input"]
    assert re.search(r"most common words in the above list\? Answer: The top 10 words that appear most often in the "
                     r"list are: 1\. [a-z]+( \d+\. [a-z]+){9}\nBelow is a numbered list", cwe)


@pytest.mark.parametrize("task,ending", [
    ("niah_single_2", r"<\|im_start\|>assistant\n The special magic number for [a-z]+-[a-z]+ mentioned in the "
                      r"provided text is"),
    ("niah_multivalue", r"<\|im_start\|>assistant\n The special magic numbers for [a-z]+-[a-z]+ mentioned in the "
                        r"provided text are"),
    ("vt", r"<\|im_start\|>assistant\n Answer: According to the chain\(s\) of variable assignment in the text above, "
           r"5 variables are assigned the value \d{5}, they are: "),
    ("cwe", r"<\|im_start\|>assistant\n Answer: The top 10 words that appear most often in the list are:"),
    ("fwe", r"<\|im_start\|>assistant\n Answer: According to the coded text above, the three most frequently "
            r"appeared words are:"),
])
def test_item8_answer_prefix_keeps_its_spaces(task, ending, formatter):
    assert re.search(ending + r"\Z", generate_sample(task, 1024, 0, formatter)["input"])


def test_item8_answer_prefix_without_chat_template(tokenizer):
    text = generate_sample("vt", 1024, 0, PromptFormatter(tokenizer, use_chat_template=False))["input"]
    assert re.search(r"in the text above\. Answer: According .* they are: \Z", text)


@pytest.mark.parametrize("task,unit", [("niah_single_1", 5), ("niah_multikey_2", 1)])
def test_item9_line_haystacks_draw_line_positions_uniformly(task, unit):
    lines = 8
    positions = Counter()
    for index in range(240):
        rendered = make_builder(TASKS[task], 42, 1024, index).render(lines * unit)
        rendered_lines = rendered.context.split("\n")
        assert len(rendered_lines) == lines + 1
        needle = [i for i, line in enumerate(rendered_lines) if rendered.outputs[0] in line]
        positions[needle[0]] += 1
    assert set(positions) == set(range(lines))              # every line position, never after the last line
    assert min(positions.values()) >= 240 / lines / 3       # roughly uniform


def test_item9_vt_statements_before_distinct_random_lines(formatter):
    used = Counter()
    for row in generate_rows("vt", 1024, 12, formatter, seed=3):
        context = between(row["input"], "following text.\n\n", "\nQuestion:", nth=1)
        lines = context.split("\n")
        positions = [i for i, line in enumerate(lines) if line.startswith("VAR ")]
        assert positions[-1] < len(lines) - 1                   # never after the last line
        assert all(b - a > 1 for a, b in zip(positions, positions[1:]))   # distinct lines: never two in a row
        used.update(positions)
    assert len(used) > 12                                       # spread over the lines, not a fixed grid


def test_item10_no_system_prompt_by_default(tokenizer):
    assert PromptFormatter(tokenizer)("Body.", " Prefix") == \
        "<|im_start|>user\nBody.<|im_end|>\n<|im_start|>assistant\n Prefix"
    row = generate_sample("niah_single_1", 1024, 0, PromptFormatter(tokenizer))
    assert row["input"].startswith("<|im_start|>user\nA special magic number is hidden")
    assert "You are a helpful AI assistant" not in row["input"]


def test_item10_system_prompt_option(tokenizer):
    formatter = PromptFormatter(tokenizer, system_prompt="Answer briefly.")
    assert formatter("Body.", " Prefix") == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                             "<|im_start|>user\nBody.<|im_end|>\n<|im_start|>assistant\n Prefix")
    assert formatter.describe()["system_prompt"] == "Answer briefly."
    row = generate_sample("niah_single_1", 1024, 0, formatter)
    assert row["length"] <= 1024 and row["input"].startswith("<|im_start|>system\nAnswer briefly.")
    with pytest.raises(ValueError, match=r"--system_prompt '  ' is empty"):
        PromptFormatter(tokenizer, system_prompt="  ")
    with pytest.raises(ValueError, match="--system_prompt needs the chat template"):
        PromptFormatter(tokenizer, use_chat_template=False, system_prompt="Answer briefly.")


def test_item11_docs_list_the_deliberate_differences():
    text = (ROOT / "docs" / "ruler.md").read_text()
    section = text[text.index("## Differences from the official RULER"):]
    for point in ("unique", "word lists", "1418-2048", "sentence", "assigned", "system", "example"):
        assert point in section, point
