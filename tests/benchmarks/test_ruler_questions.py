"""RULER with several questions per context (questions_per_context K): every question's prompt is the official
text for its question, each answer is in the context once, the follow-up is a real second user turn, K is
checked before any work, rows are deterministic and cached apart; kv_retrieval's prompt is InfiniteBench's."""

from __future__ import annotations

import json
import re

import pytest

from pyramidkv.benchmarks.prompting import followup_frame
from pyramidkv.benchmarks.ruler import generate as gen
from pyramidkv.benchmarks.ruler.generate import (
    PromptFormatter, fit_sample, generate_rows, generate_sample, infer_task_length, load_or_generate,
    read_data_file,
)
from pyramidkv.benchmarks.ruler.tasks import TASKS, check_questions_per_context, make_builder
from tests.benchmarks.test_ruler_official import (
    CHAT_USER_CLOSE, CHAT_USER_OPEN, NEEDLE, NIAH_SETUP, VT_ANSWER_PREFIX, VT_STATEMENT, VT_TEMPLATE, between,
    in_chat, is_noise_line, official_niah,
)

# InfiniteBench's kv_retrieval (data/construct_synthetic_dataset.py and src/prompt.py), written out by hand: the
# instruction, "JSON data:\n{...}" as the context, then 'Key: "..."' and the answer's start.
KV_TEMPLATE = "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"
KV_ANSWER_PREFIX = " The value associated with the specified key is: "   # InfiniteBench: "\nThe value ... is: "

# Tasks that pose 3 questions, at a length each fits (vt: 3 chains and its 500-token example need 2048).
K3 = {"niah_multikey_1": 1024, "niah_multikey_2": 1024, "niah_multikey_3": 1024, "niah_multiquery": 1024,
      "vt": 2048, "kv_retrieval": 1024}
SAME_CONTEXT = ("niah_multikey_1", "niah_multikey_2", "niah_multikey_3", "niah_multiquery")


def full_prompts(row) -> list[str]:
    return [row["input"][:row["question_start"]] + q["question"] for q in row["questions"]]


def check_niah(task, text, outputs) -> str:
    """`text` is the official prompt asking one key (niah_multiquery: its plural instruction); returns the key."""
    _, key_re, kind, value_re, _, _, num_queries = NIAH_SETUP[task]
    context = between(text, "afterwards.\n", "\nWhat ")
    needles = re.findall(re.escape(NEEDLE).replace(r"\{type_needle_v\}", kind)
                         .replace(r"\{key\}", f"({key_re})").replace(r"\{value\}", f"({value_re})"), context)
    keys = [k for k, v in needles if v in outputs]
    assert len(keys) == 1 and len(outputs) == 1, (keys, outputs)
    singular = official_niah(context, keys[0], kind, 1, 1)
    if num_queries == 1:
        assert text == singular
    else:   # the task's own (plural) text up to the end of the context, then the singular question
        queried = list(dict.fromkeys(k for k, _ in needles))
        plural = official_niah(context, ", ".join(queried[:-1]) + ", and " + queried[-1], kind, 1, num_queries)
        cut = plural.index(context) + len(context)
        assert text == plural[:cut] + singular[singular.index(context) + len(context):]
    return keys[0]


def check_vt(text, outputs) -> str:
    """`text` is the official vt prompt for one of several chains; each chain resolves to its own variables."""
    context = between(text, "following text.\n\n", "\nQuestion:", nth=1)
    value = re.search(r"assigned the value (\d{5}) in the text above\.<\|im_end\|>", text).group(1)
    demo_input = text[len(CHAT_USER_OPEN):text.index("they are: ") + len("they are: ")]
    demo_vars = between(text, "they are:  ", "\n").split(" ")
    official = (demo_input + " " + " ".join(demo_vars) + "\n\n" + VT_TEMPLATE.format(context=context, query=value)
                + VT_ANSWER_PREFIX.format(num_v=5, query=value))
    assert text == in_chat(official, " Answer: According")
    lines = context.split("\n")
    statements = [VT_STATEMENT.fullmatch(line) for line in lines]
    assert all(m or is_noise_line(line) for m, line in zip(statements, lines))
    positions = [i for i, m in enumerate(statements) if m]
    assert positions[-1] < len(lines) - 1 and all(b - a > 1 for a, b in zip(positions, positions[1:]))
    found = [m.groups() for m in statements if m]
    holds = [name for name, _, number in found if number == value]           # follow the chain, in text order
    for name, source, _ in found:
        if source in holds:
            holds.append(name)
    assert holds == outputs and len(holds) == 5 and context.count(f"= {value}\n") == 1
    return value


def check_kv(text, outputs) -> str:
    context = between(text, "below.\n\n", "\n\nKey: ")
    key = re.search(r'\n\nKey: "([0-9a-f-]{36})"<', text).group(1)
    assert text == (CHAT_USER_OPEN + KV_TEMPLATE.format(context=context, input=f'Key: "{key}"') + CHAT_USER_CLOSE
                    + KV_ANSWER_PREFIX)
    assert context.startswith("JSON data:\n{")
    pairs = json.loads(context[len("JSON data:\n"):], object_pairs_hook=list)
    assert len({k for k, _ in pairs}) == len(pairs) > 3 and len({v for _, v in pairs}) == len(pairs)
    assert [v for k, v in pairs if k == key] == outputs
    return key


CHECKS = {"niah": check_niah, "vt": lambda task, text, outputs: check_vt(text, outputs),
          "kv": lambda task, text, outputs: check_kv(text, outputs)}


@pytest.mark.parametrize("task", list(K3))
def test_every_question_is_the_official_prompt(task, formatter):
    row = generate_sample(task, K3[task], 1, formatter, questions_per_context=3)
    assert row["length"] <= K3[task] and len(row["questions"]) == 3
    prompts = full_prompts(row)
    assert prompts[0] == row["input"] and row["questions"][0]["outputs"] == row["outputs"]
    asked = [CHECKS[TASKS[task].family](task, text, q["outputs"]) for text, q in zip(prompts, row["questions"])]
    assert len(set(asked)) == 3                                            # three different keys / chains
    assert len({tuple(q["outputs"]) for q in row["questions"]}) == 3       # with different answers
    context = row["input"][:row["question_start"]]
    for q in row["questions"]:
        if task != "vt":
            assert all(context.count(v) == 1 for v in q["outputs"])       # each answer in the context, once
        assert not any(v in q["question"] for v in q["outputs"])          # and not in the question part
    # The fit leaves room for the longest question part.
    assert max(formatter.count(p) for p in prompts) + TASKS[task].max_new_tokens <= K3[task]


def test_kv_retrieval_one_question(formatter):
    row = generate_sample("kv_retrieval", 1024, 0, formatter)
    check_kv(row["input"], row["outputs"])
    assert "questions" not in row and 1024 - 60 < row["length"] <= 1024 and TASKS["kv_retrieval"].metric == \
        "string_match_all"


@pytest.mark.parametrize("task", list(K3))
def test_question_one_is_the_one_question_row(task, formatter):
    """Same context: at the fitted size, question 1's prompt is what one question renders (niah_multiquery asks
    its keys one by one, so only the context is shared); vt and kv_retrieval hold K chains / asked pairs, so
    there only the first question's draws (chain, pair) are those of one question."""
    length = K3[task]
    best = fit_sample(task, length, 2, formatter, questions_per_context=3)
    row = generate_sample(task, length, 2, formatter, questions_per_context=3)
    one = make_builder(TASKS[task], 42, length, 2, count_tokens=formatter.count).render(best.size)
    if task in SAME_CONTEXT:
        assert one.context == best.rendered.context
        prompt = formatter(one.body, one.answer_prefix)
        assert prompt[:row["question_start"]] == row["input"][:row["question_start"]]
        if task != "niah_multiquery":
            assert prompt == row["input"]
    if task != "niah_multiquery":
        assert row["outputs"] == generate_sample(task, length, 2, formatter)["outputs"]


@pytest.mark.parametrize("task", list(K3))
def test_followup_is_a_second_user_turn(task, formatter, tokenizer):
    row = generate_sample(task, K3[task], 0, formatter, questions_per_context=3)
    for q in row["questions"]:
        message, prefix = q["question"].split(CHAT_USER_CLOSE)
        conversation = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Some context."}, {"role": "assistant", "content": "ANSWER"},
             {"role": "user", "content": message.lstrip("\n")}], tokenize=False, add_generation_prompt=True)
        assert q["followup"].endswith(prefix)
        assert conversation.endswith("ANSWER" + tokenizer.eos_token + q["followup"][:-len(prefix)])
        assert q["followup"].startswith("\n<|im_start|>user\n" + message.lstrip("\n"))
    plain = generate_sample(task, K3[task], 0, PromptFormatter(tokenizer, use_chat_template=False),
                            questions_per_context=3)
    for q in plain["questions"]:
        assert q["followup"] == "\n" + q["question"].lstrip("\n")      # the question part, one newline first


def test_followup_frame(tokenizer):
    assert followup_frame(tokenizer) == ("\n<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n")
    hidden = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    hidden.chat_template = "{% for m in messages %}{{ m['role'] }}{% endfor %}"
    with pytest.raises(ValueError, match="does not show a conversation's messages verbatim"):
        followup_frame(hidden)
    hidden.chat_template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}<END>{% endfor %}"
    with pytest.raises(ValueError, match="does not end an assistant reply with the EOS token"):
        followup_frame(hidden)


@pytest.mark.parametrize("task,k,allowed", [
    ("niah_single_1", 2, True), ("niah_multivalue", 2, True), ("cwe", 2, True), ("fwe", 2, True),
    ("qa_1", 2, True), ("niah_multikey_1", 5, True), ("niah_multiquery", 5, True), ("vt", 11, True),
    ("kv_retrieval", 11, True), ("niah_multikey_2", 0, False), ("vt", -1, False), ("kv_retrieval", 1.5, False),
    ("niah_multikey_1", "2", False),
])
def test_too_many_questions_or_below_one_refused(task, k, allowed, formatter, tmp_path, monkeypatch):
    message = f"task {task} cannot pose {k} questions per context" if allowed else \
        "questions_per_context must be a whole number of at least 1"
    monkeypatch.setattr(gen, "make_builder", lambda *a, **kw: pytest.fail("generation started"))
    for call in (lambda: check_questions_per_context(task, k),
                 lambda: generate_sample(task, 1024, 0, formatter, questions_per_context=k),
                 lambda: load_or_generate(task, 1024, 1, formatter, tmp_path, "m", questions_per_context=k)):
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            call()
        assert "\n" not in str(e.value)
    assert not list(tmp_path.iterdir())
    if allowed:
        assert "niah_multikey_1 (up to 4)" in str(e.value) and "kv_retrieval (up to 10)" in str(e.value)


def test_the_most_questions_allowed_pass_the_check():
    for name, count in {"niah_multikey_1": 4, "niah_multiquery": 4, "niah_multikey_2": 10, "vt": 10}.items():
        check_questions_per_context(name, count)
        check_questions_per_context(name, 1)
    check_questions_per_context("cwe", 1)


def test_same_seed_same_rows_and_own_cache_file(formatter, tmp_path, monkeypatch):
    a = generate_rows("niah_multikey_2", 1024, 2, formatter, seed=7, questions_per_context=3)
    assert gen.rows_to_jsonl(a) == gen.rows_to_jsonl(generate_rows("niah_multikey_2", 1024, 2, formatter, seed=7,
                                                                   questions_per_context=3))
    other = generate_rows("niah_multikey_2", 1024, 2, formatter, seed=8, questions_per_context=3)
    assert [r["questions"] for r in a] != [r["questions"] for r in other]
    rows = load_or_generate("niah_multikey_2", 1024, 2, formatter, tmp_path, "m", seed=7, questions_per_context=3)
    assert rows == a and (tmp_path / "m" / "niah_multikey_2_1024_q3.jsonl").read_text() == gen.rows_to_jsonl(a)
    assert (tmp_path / "m" / "niah_multikey_2_1024_q3.meta.json").is_file()
    one = load_or_generate("niah_multikey_2", 1024, 2, formatter, tmp_path, "m", seed=7)
    assert (tmp_path / "m" / "niah_multikey_2_1024.jsonl").is_file() and "questions" not in one[0]
    monkeypatch.setattr(gen, "generate_rows", lambda *a, **k: pytest.fail("regenerated"))
    assert load_or_generate("niah_multikey_2", 1024, 2, formatter, tmp_path, "m", seed=7, questions_per_context=3) \
        == a
    assert infer_task_length(tmp_path / "m" / "niah_multikey_2_1024_q3.jsonl") == ("niah_multikey_2", 1024)
    assert read_data_file(tmp_path / "m" / "niah_multikey_2_1024_q3.jsonl")[0]["questions"] == a[0]["questions"]


@pytest.mark.parametrize("questions,error", [
    ("x", r"row 1: \"questions\" must be a non-empty list of objects"),
    ([], r"row 1: \"questions\" must be a non-empty list"),
    (["x"], r"row 1: \"questions\"\[0\] must be an object"),
    ([{"outputs": ["a"]}], r"row 1: \"questions\"\[0\]: \"question\" must be a non-empty string"),
    ([{"question": "q", "outputs": []}], r"row 1: \"questions\"\[0\]: \"outputs\" must be a non-empty list"),
    ([{"question": "q", "outputs": ["a"]}, {"question": "q", "outputs": ["b"], "followup": 3}],
     r"row 1: \"questions\"\[1\]: \"followup\" must be a non-empty string"),
    ([{"question": "q", "outputs": ["a"], "answer": "a"}], r"row 1: \"questions\"\[0\] has unknown fields"),
])
def test_data_file_questions_checked(questions, error, tmp_path):
    path = tmp_path / "vt_1024_q2.jsonl"
    good = {"input": "ctx? A:", "outputs": ["a"], "question_start": 3,
            "questions": [{"question": "? A:", "outputs": ["a"]}, {"question": "? B:", "followup": "\nB", "outputs": ["b"]}]}
    path.write_text(json.dumps(good) + "\n")
    assert read_data_file(path, "vt")[0]["questions"] == good["questions"]
    path.write_text(json.dumps({**good, "questions": questions}) + "\n")
    with pytest.raises(ValueError, match=error) as e:
        read_data_file(path, "vt")
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_sample_only_command_refuses_before_loading_the_tokenizer(tmp_path, capsys, monkeypatch):
    import transformers

    from pyramidkv.benchmarks.ruler.__main__ import main

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(SystemExit) as e:
        main(["--tasks", "niah_multikey_1", "cwe", "--questions_per_context", "2", "--cache_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert err.startswith("python -m pyramidkv.benchmarks.ruler: error: task cwe cannot pose 2 questions")
