"""--question_as_decode (Quest's evaluation protocol): each prompt's context is prefilled, its question part fed
as decode steps. Where each runner cuts (checked against the question text found in the prompt), that fullkv
predicts the same either way, that a compressing method then holds the question beside its budget, the run
folder, run_meta.json and the fingerprint, and the refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pyramidkv.benchmarks.longbench import run as LB
from pyramidkv.benchmarks.ruler import run as RU
from pyramidkv.benchmarks.ruler.generate import PromptFormatter, generate_sample
from pyramidkv.benchmarks.ruler.tasks import OFFLINE_TASKS
from tests.helpers import ROOT, load_script, longbench_data_dir


needle_runner = load_script("run_needle_in_haystack", ROOT / "run_needle_in_haystack.py")

# The text each RULER task family puts right after its haystack (RULER's templates, read off
# pyramidkv/benchmarks/ruler/tasks.py by hand): the question part starts at its last occurrence.
RULER_QUESTION_LEADS = {
    "niah": re.compile(r"\nWhat (is|are all) the special magic"),
    "vt": re.compile(r"\nQuestion: Find all variables that are assigned the value"),
    "cwe": re.compile(r"\nQuestion: What are the \d+ most common words"),
    "fwe": re.compile(r"\nQuestion: Do not provide any explanation\."),
    "qa": re.compile(r"\n\nAnswer the question based on the given documents\."),
}


def _family(task: str) -> str:
    return task.split("_")[0] if task.startswith(("niah", "qa")) else task


def _question_offset(prompt: str, task: str) -> int:
    """Where the question part begins, found from the question text alone (not from the generator)."""
    matches = list(RULER_QUESTION_LEADS[_family(task)].finditer(prompt))
    assert matches, f"{task}: no question found in the prompt"
    return matches[-1].start()


def _first_token_at(tokenizer, text: str, offset: int) -> int:
    """The index of the first token of `text` that starts at character `offset` or later."""
    spans = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True).offset_mapping
    return next(i for i, (start, _) in enumerate(spans) if start >= offset)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _fail_to_load(monkeypatch):
    import pyramidkv.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model was loaded"))


# --- where each runner cuts ------------------------------------------------------------------------

def _squad(tmp_path: Path) -> Path:
    paragraphs = [{"context": f"Paragraph {i}. The town of Town{i} was founded in {1000 + i}. " * 3,
                   "qas": [{"id": f"q{i}", "question": f"When was Town{i} founded?", "is_impossible": False,
                            "answers": [{"text": f"{1000 + i}", "answer_start": 0}]}]} for i in range(30)]
    path = tmp_path / "dev-v2.0.json"
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "T", "paragraphs": paragraphs}]}))
    return path


def _hotpot(tmp_path: Path) -> Path:
    items = [{"_id": str(i), "question": f"Who built bridge {i}?", "answer": f"Builder{i}",
              "context": [[f"Bridge {i}", [f"Bridge {i} was built by Builder{i}. ", "It is long."]],
                          [f"River {i}", [f"River {i} flows under bridge {i}."]]]} for i in range(30)]
    path = tmp_path / "hotpot_dev_distractor_v1.json"
    path.write_text(json.dumps(items))
    return path


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "plain"])
def test_ruler_question_start_of_every_task_is_where_its_question_begins(tokenizer, tmp_path, chat):
    from pyramidkv.generation import split_prompt

    formatter = PromptFormatter(tokenizer, use_chat_template=chat)
    squad, hotpot = str(_squad(tmp_path)), str(_hotpot(tmp_path))
    for task in (*OFFLINE_TASKS, "qa_1", "qa_2"):
        row = generate_sample(task, 1024, 0, formatter, squad_file=squad, hotpot_file=hotpot)
        prompt = row["input"]
        assert row["question_start"] == _question_offset(prompt, task), task
        context, question = split_prompt(tokenizer, prompt, row["question_start"])
        assert context + question == tokenizer(prompt, add_special_tokens=False).input_ids
        assert len(context) == _first_token_at(tokenizer, prompt, _question_offset(prompt, task))
        # The question tokens are the prompt's text from there on (answer prefix included), but for white
        # space that a token straddling the boundary takes into the context (qa: a document's trailing space).
        text, tail = tokenizer.decode(question), prompt[row["question_start"]:]
        assert tail.endswith(text) and not tail[:len(tail) - len(text)].strip(), task


def _ruler_args(model_dir, save_dir, *extra, method=("--method", "snapkv", "--max_capacity_prompts", "64")):
    return ["--model_path", str(model_dir), *method, "--save_dir", str(save_dir), "--num_threads", "1",
            "--device", "cpu", *extra]


def test_ruler_adapter_sets_the_token_index_of_the_question(tiny_model_dir, tokenizer, tmp_path):
    """The samples the RULER runner decodes: the whole prompt's tokens, cut at the question found in the
    text; without the flag no cut."""
    argv = _ruler_args(tiny_model_dir, tmp_path, "--tasks", "niah_multivalue", "cwe", "--context_lengths", "1024",
                       "--num_samples", "2")
    for flag in (True, False):
        benchmark = RU.Ruler()
        args = RU.build_parser().parse_args(argv + (["--question_as_decode"] if flag else []))
        benchmark.check_arguments(args)
        files = benchmark.prepare(args, tokenizer, None, tmp_path)
        assert [f.name for f in files] == ["niah_multivalue@1024", "cwe@1024"]
        for sample_file, sample_set in zip(files, benchmark.sets):
            for sample, row in zip(sample_file.samples, sample_set.rows):
                assert list(sample.prompt) == tokenizer(row["input"], add_special_tokens=False).input_ids
                expected = _first_token_at(tokenizer, row["input"], _question_offset(row["input"], sample_set.task))
                assert sample.question_start == (expected if flag else None)


# Every LongBench template's text after {context}, as the official dataset2prompt.json writes it, with
# {input} the place of the row's input (copied by hand: a changed template shows here).
LONGBENCH_AFTER_CONTEXT = {
    "narrativeqa": "\n\nNow, answer the question based on the story asconcisely as you can, using a single phrase if "
                   "possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "\n\n Answer the question based on the above article as concisely as you can, using a single phrase "
              "or sentence if possible. If the question cannot be answered based on the information in the "
              "article, write \"unanswerable\". If the question is a yes/no question, answer \"yes\", \"no\", or "
              "\"unanswerable\". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "multifieldqa_en": "\n\nNow, answer the following question based on the above text, only give me the answer "
                       "and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "multifieldqa_zh": "\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": "\n\nAnswer the question based on the given passages. Only give me the answer and do not output "
                "any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "\n\nAnswer the question based on the given passages. Only give me the answer and do not output "
                "any other words.\n\nQuestion: {input}\nAnswer:",
    "musique": "\n\nAnswer the question based on the given passages. Only give me the answer and do not output "
               "any other words.\n\nQuestion: {input}\nAnswer:",
    "dureader": "\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",
    "gov_report": "\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "\n\nNow, answer the query based on the above meeting transcript in one or more sentences.\n\n"
             "Query: {input}\nAnswer:",
    "multi_news": "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "\n\n会议总结：",
    "trec": "\n{input}",
    "triviaqa": "\n\n{input}",
    "samsum": "\n\n{input}",
    "lsht": "\n{input}",
    "passage_count": "\n\nPlease enter the final count of unique paragraphs after removing duplicates. The output "
                     "format should only contain the number, such as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of the "
                            "paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", "
                            "\"Paragraph 2\", etc.\n\nThe answer is: ",
    "passage_retrieval_zh": "\n\n下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是\"段落1\"，\"段落2\"等格式\n\n答案是：",
    "lcc": "Next line of code:\n",
    "repobench-p": "{input}Next line of code:\n",
}


def _closing(tokenizer, dataset: str) -> str:
    from pyramidkv.benchmarks.prompting import chat_frame

    return "" if dataset in LB.NO_CHAT_TEMPLATE else chat_frame(tokenizer)[1]


def test_longbench_question_start_of_every_dataset(tokenizer):
    """Synthetic rows: the question part decodes to the template's text after the context with the row's
    input, then the chat template's closing; the context part ends with the row's context."""
    assert set(LONGBENCH_AFTER_CONTEXT) == set(LB.ALL_DATASETS)
    builder = LB.PromptBuilder(tokenizer)
    for dataset in LB.ALL_DATASETS:
        row = {"context": "The material begins here. " + "Some facts about the matter. " * 40 + "It ends here.",
               "input": "Which fact came first in the material?"}
        ids, start = builder.build_with_question(dataset, row, 100_000)
        assert ids == builder.build(dataset, row, 100_000)[0], dataset
        question, context = tokenizer.decode(ids[start:]), tokenizer.decode(ids[:start])
        assert question == LONGBENCH_AFTER_CONTEXT[dataset].format(input=row["input"]) + _closing(tokenizer, dataset)
        assert context.endswith(row["context"]) and row["input"] not in context, dataset


def test_longbench_question_start_through_middle_truncation(tokenizer):
    builder = LB.PromptBuilder(tokenizer)
    row = {"context": "Some facts about the matter. " * 300 + "The end.", "input": "Which fact came first?"}
    ids, start = builder.build_with_question("hotpotqa", row, 400)
    assert ids == builder.build("hotpotqa", row, 400)[0]
    assert tokenizer.decode(ids[start:]) == LONGBENCH_AFTER_CONTEXT["hotpotqa"].format(input=row["input"]) + \
        _closing(tokenizer, "hotpotqa")
    # A question longer than the kept end half: the cut falls inside it, the question is the kept tail (the
    # 200 last tokens) and the context the kept head (the 200 first).
    from pyramidkv.benchmarks.prompting import chat_frame

    before = len(tokenizer(chat_frame(tokenizer)[0], add_special_tokens=False).input_ids)
    long_row = {"context": "Some facts about the matter. " * 50 + "The end.", "input": "Which fact came first? " * 150}
    text = LB.dataset2prompt()["hotpotqa"].format(**long_row)
    whole = len(tokenizer(text, add_special_tokens=False).input_ids)
    context = len(tokenizer(text[:text.index("The end.") + 8], add_special_tokens=False).input_ids)
    assert 200 < context < whole - 200                          # the premise: the question starts in the cut
    ids, start = builder.build_with_question("hotpotqa", long_row, 400)
    assert ids == builder.build("hotpotqa", long_row, 400)[0]
    assert start == before + 200
    assert "Which fact" not in tokenizer.decode(ids[:start]) and "The end." not in tokenizer.decode(ids)
    assert tokenizer.decode(ids[start:]).endswith("came first? \nAnswer:" + _closing(tokenizer, "hotpotqa"))


def test_longbench_adapter_on_the_real_rows(tokenizer, tmp_path):
    """The shipped LongBench rows: the question part holds the row's input (where the template has one) and
    starts where the template's text after the context starts in the prompt."""
    data = longbench_data_dir()
    argv = ["--method", "fullkv", "--data_dir", str(data), "--datasets", "multi_news", "multifieldqa_zh",
            "passage_retrieval_zh", "--max_num_examples", "3", "--max_length", "3000", "--question_as_decode"]
    benchmark = LB.LongBench()
    args = LB.build_parser().parse_args(argv)
    benchmark.check_arguments(args)
    files = benchmark.prepare(args, tokenizer, None, tmp_path)
    for sample_file in files:
        rows = {r["_id"]: r for r in LB.load_rows(sample_file.name, data)}
        after = LONGBENCH_AFTER_CONTEXT[sample_file.name]
        lead = after.split("{input}")[0]
        for sample in sample_file.samples:
            ids, row = list(sample.prompt), rows[sample.key]
            question = tokenizer.decode(ids[sample.question_start:])
            expected = after.format(input=row.get("input")) + _closing(tokenizer, sample_file.name)
            # The question part is the template's text after the context, but for white space that a token
            # straddling the boundary takes into the context part.
            assert expected.endswith(question) and not expected[:len(expected) - len(question)].strip()
            if "{input}" in after:
                assert row["input"] in question
            assert row["context"].rstrip()[-20:] in tokenizer.decode(ids[:sample.question_start])[-40:]


def test_needle_question_start_is_after_the_document(tokenizer, tmp_path):
    from pyramidkv.benchmarks import needle as nd

    builder = nd.NeedleHaystack(tokenizer, "The sky is blue. Grass is green. " * 400)
    for depth in (0, 50, 100):
        cell = builder.build(800, depth)
        question = tokenizer.decode(cell.input_ids[cell.question_start:])
        assert question.startswith(f"\n</document>\n\nQuestion: {nd.RETRIEVAL_QUESTION}")
        assert "Question:" not in tokenizer.decode(cell.input_ids[:cell.question_start])


# --- fullkv: the same predictions either way --------------------------------------------------------

# Fullkv attends to the same tokens either way whatever the weights: a random model whose weights have std 0.2
# (sharp_model_dir), whose greedy text moves with any change of what it attends to and differs from prompt to
# prompt, runs these in seconds where SmolLM2 took a minute and a half. (generate()'s own question feed is
# checked on SmolLM2's real answers in tests/generation/test_generation.py.)

def _predictions_depend_on_the_prompt(rows: list[dict]) -> bool:
    """Not a constant string: the comparisons below would then hold whatever each run attended to."""
    return len({r["pred"] for r in rows}) == len(rows) and all(r["pred"].strip() for r in rows)


def test_fullkv_ruler_predictions_do_not_change(sharp_model_dir, tmp_path):
    """Fullkv attends to the same tokens whether the question is prefilled or fed step by step."""
    common = ["--tasks", "niah_single_1", "niah_multikey_1", "--context_lengths", "768", "--num_samples", "2",
              "--cache_dir", str(tmp_path / "data"), "--eval_batch_size", "1"]
    for save, extra in (("plain", []), ("fed", ["--question_as_decode"])):
        assert RU.main(_ruler_args(sharp_model_dir, tmp_path / save, *common, *extra,
                                   method=("--method", "fullkv"))) == 0
    model = Path(sharp_model_dir).name
    plain, fed = tmp_path / "plain" / f"{model}_full" / "fullkv", tmp_path / "fed" / f"{model}_full" / \
        "fullkv_question_as_decode"
    for name in ("niah_single_1_768.jsonl", "niah_multikey_1_768.jsonl"):
        assert _rows(fed / name) == _rows(plain / name)
        assert _predictions_depend_on_the_prompt(_rows(plain / name)), name


def test_fullkv_longbench_and_needle_predictions_do_not_change(sharp_model_dir, tmp_path):
    common = ["--method", "fullkv", "--model_path", sharp_model_dir, "--device", "cpu", "--num_threads", "1"]
    lb = [*common, "--data_dir", str(longbench_data_dir()), "--datasets", "multi_news", "multifieldqa_zh",
          "--max_num_examples", "2", "--max_length", "500", "--max_new_tokens", "12"]
    nd = [*common, "--s_len", "500", "--e_len", "500", "--num_depths", "2", "--max_new_tokens", "16"]
    for save, extra in (("plain", []), ("fed", ["--question_as_decode"])):
        assert LB.main([*lb, "--save_dir", str(tmp_path / "lb" / save), *extra]) == 0
        assert needle_runner.main([*nd, "--save_dir", str(tmp_path / "nd" / save), *extra]) == 0
    model = Path(sharp_model_dir).name
    for benchmark, names in (("lb", ("multi_news.jsonl", "multifieldqa_zh.jsonl")), ("nd", ("needle.jsonl",))):
        for name in names:
            plain = _rows(tmp_path / benchmark / "plain" / f"{model}_full" / "fullkv" / name)
            fed = _rows(tmp_path / benchmark / "fed" / f"{model}_full" / "fullkv_question_as_decode" / name)
            assert fed == plain and _predictions_depend_on_the_prompt(plain), name


# --- a compressing method: the question is not in the prefill selection -------------------------------

def test_snapkv_holds_the_question_beside_its_budget(tiny_model_dir, tokenizer, tmp_path):
    """SnapKV at 64 tokens per head: without the flag the question is compressed with the prompt (64 held
    after prefill); with it only the context is, and every question token is held in full after it. The
    tiny random model never stops early, so each row holds its 127 fed-back answer tokens too."""
    from transformers import AutoConfig

    common = ["--tasks", "niah_single_1", "--context_lengths", "1024", "--num_samples", "2",
              "--cache_dir", str(tmp_path / "data")]
    for save, extra in (("plain", []), ("fed", ["--question_as_decode"])):
        assert RU.main(_ruler_args(tiny_model_dir, tmp_path / save, *common, *extra)) == 0
    config = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = config.num_hidden_layers * config.num_key_value_heads * head_dim * 2 * 4   # K and V, float32
    model = Path(tiny_model_dir).name
    plain = _rows(tmp_path / "plain" / f"{model}_64" / "snapkv" / "niah_single_1_1024.jsonl")
    fed = _rows(tmp_path / "fed" / f"{model}_64" / "snapkv_question_as_decode" / "niah_single_1_1024.jsonl")
    data = _rows(tmp_path / "data" / model / "niah_single_1_1024.jsonl")
    for p, f, row in zip(plain, fed, data):
        whole = tokenizer(row["input"], add_special_tokens=False).input_ids
        question = len(whole) - _first_token_at(tokenizer, row["input"], _question_offset(row["input"], "niah_single_1"))
        assert p["prompt_tokens"] == f["prompt_tokens"] == len(whole)
        assert p["kv_bytes"] == per_token * (64 + 127)
        assert f["kv_bytes"] == per_token * (64 + question + 127)


# --- the run folder, run_meta.json, the fingerprint ------------------------------------------------

def test_folder_name_run_meta_and_a_resume_with_the_other_setting(tiny_model_dir, tmp_path, capsys):
    common = ["--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "1"]
    model = Path(tiny_model_dir).name
    assert RU.main(_ruler_args(tiny_model_dir, tmp_path, *common, "--print_run_dir")) == 0
    assert RU.main(_ruler_args(tiny_model_dir, tmp_path, *common, "--question_as_decode", "--print_run_dir")) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / f"{model}_64" / "snapkv"),
                                               str(tmp_path / f"{model}_64" / "snapkv_question_as_decode")]
    assert RU.main(_ruler_args(tiny_model_dir, tmp_path, *common, "--question_as_decode")) == 0
    fed = tmp_path / f"{model}_64" / "snapkv_question_as_decode"
    meta = json.loads((fed / "run_meta.json").read_text())
    assert meta["arguments"]["question_as_decode"] is True
    assert meta["fingerprint"]["arguments"]["question_as_decode"] is True

    # The results moved to the plain folder name: resuming there without the flag is refused.
    fed.rename(tmp_path / f"{model}_64" / "snapkv")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        RU.main(_ruler_args(tiny_model_dir, tmp_path, *common))
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "arguments.question_as_decode: True -> False" in err


def test_a_folder_from_before_the_flag_resumes_without_it(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """A stored fingerprint without the argument equals a run that leaves it off (existing folders resume)."""
    common = ["--tasks", "niah_single_1", "--context_lengths", "512", "--num_samples", "1"]
    assert RU.main(_ruler_args(tiny_model_dir, tmp_path, *common)) == 0
    run = tmp_path / f"{Path(tiny_model_dir).name}_64" / "snapkv"
    meta = json.loads((run / "run_meta.json").read_text())
    assert meta["arguments"]["question_as_decode"] is False
    del meta["fingerprint"]["arguments"]["question_as_decode"]
    (run / "run_meta.json").write_text(json.dumps(meta))
    _fail_to_load(monkeypatch)
    capsys.readouterr()
    assert RU.main(_ruler_args(tiny_model_dir, tmp_path, *common)) == 0
    assert "already done" in capsys.readouterr().out


# --- refusals, one line, before any model loads -----------------------------------------------------

def _one_line_error(main, argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    return err


def test_a_longbench_template_without_a_question_part_is_refused(tmp_path, monkeypatch, capsys):
    """No shipped template ends at its context (the trailing instruction is the question part); one that
    did is refused naming the dataset."""
    templates = {**LB.dataset2prompt(), "gov_report": "Summarize this report.\n\n{context}\n\n"}
    monkeypatch.setattr(LB, "dataset2prompt", lambda: templates)
    _fail_to_load(monkeypatch)
    argv = ["--method", "snapkv", "--data_dir", str(longbench_data_dir()), "--datasets", "multi_news", "gov_report",
            "--save_dir", str(tmp_path), "--question_as_decode"]
    err = _one_line_error(LB.main, argv, capsys)
    assert "--question_as_decode: the prompt template of gov_report has nothing after its context" in err
    assert not any(tmp_path.iterdir())


def test_shipped_longbench_templates_all_have_a_question_part():
    LB.check_question_parts(LB.ALL_DATASETS)


def test_a_ruler_file_without_question_start_is_refused(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """RULER's own files do not record where the question begins."""
    from transformers import AutoTokenizer

    formatter = PromptFormatter(AutoTokenizer.from_pretrained(tiny_model_dir))
    row = generate_sample("niah_single_2", 1024, 0, formatter)
    path = tmp_path / "elsewhere" / "1024" / "data" / "niah_single_2" / "validation.jsonl"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({k: v for k, v in row.items() if k != "question_start"}) + "\n")
    _fail_to_load(monkeypatch)
    err = _one_line_error(RU.main, _ruler_args(tiny_model_dir, tmp_path / "out", "--data_file", str(path),
                                              "--question_as_decode"), capsys)
    assert f"--question_as_decode: {path}: sample 0 records no \"question_start\"" in err
    assert not (tmp_path / "out").exists()
    # The same row with its offset (this generator's own files) runs.
    path.write_text(json.dumps(row) + "\n")
    monkeypatch.undo()
    assert RU.main(_ruler_args(tiny_model_dir, tmp_path / "out", "--data_file", str(path), "--question_as_decode")) == 0


def test_protocol_refuses_a_sample_without_a_question_part():
    from pyramidkv import make_method
    from pyramidkv.runner.protocol import Sample, SampleFile, check_samples

    method = make_method("snapkv", budget=32)
    for start, what in ((None, "has no question part;"), (0, "at token 0 of 40, which leaves no context;"),
                        (40, "at token 40 of 40, which leaves no question;")):
        files = [SampleFile("t", "t.jsonl", [Sample(3, list(range(40)), 4, label="t: sample 3",
                                                    question_start=start)])]
        with pytest.raises(ValueError, match=f"^--question_as_decode: t: sample 3 .*{what}"):
            check_samples(files, method, None, "m", question_as_decode=True)
        check_samples(files, method, None, "m")                    # without the flag: not looked at
