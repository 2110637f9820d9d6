"""The needle with several questions per context: K needles of one form, each asked once; every question's
prompt is the one-question prompt for it, each needle is in the document once, the follow-up is a real second
user turn, K is checked, and each needle is scored against its own words."""

from __future__ import annotations

import pytest

from pyramidkv.benchmarks import needle as nd


@pytest.fixture(scope="module")
def builders(tokenizer):
    """A builder per length budget, sharing one tokenized haystack."""
    first = nd.NeedleHaystack(tokenizer, nd.load_haystack_text())
    first.prepare(2000)
    second = nd.NeedleHaystack(tokenizer, first.text, length_budget="prompt")
    second._ids, second._ends = first._ids, first._ends
    return {"context": first, "prompt": second}


@pytest.fixture(scope="module")
def builder(builders):
    return builders["context"]


@pytest.mark.parametrize("length_budget", nd.LENGTH_BUDGETS)
@pytest.mark.parametrize("depth", [0, 50, 100])
def test_every_question_is_its_one_question_prompt(tokenizer, builders, depth, length_budget):
    b = builders[length_budget]
    cell = b.build(1500, depth, questions_per_context=3)
    assert b.build(1500, depth).input_ids != cell.input_ids                     # two more needles
    head = tokenizer.decode(cell.input_ids[:cell.question_start])
    document = head[head.index("<document>\n") + len("<document>\n"):]
    longest = 0
    for (needle, question), q in zip(nd.NEEDLES[:3], cell.questions):
        assert document.count(needle) == 1 and q["outputs"] == [needle]
        assert head + q["question"] == b.render(document, question)               # text after the document
        ids = cell.input_ids[:cell.question_start] + tokenizer(q["question"], add_special_tokens=False).input_ids
        longest = max(longest, len(ids))
    assert tokenizer.decode(cell.input_ids) == head + cell.questions[0]["question"]   # the prompt asks question 1
    assert cell.context_tokens <= 1500 - b.buffer                                     # needles inside the budget
    if length_budget == "prompt":
        assert longest <= 1500 - b.buffer
    # Needle 1 at the cell's depth, the others spread: three different places in the document.
    starts = sorted(document.index(n) for n, _ in nd.NEEDLES[:3])
    assert starts[0] < starts[1] < starts[2] and abs(cell.actual_depth_percent - depth) < 5


def test_one_question_is_the_cell_of_before(builder):
    cell = builder.build(2000, 33, questions_per_context=1)
    assert cell.questions is None
    assert cell.input_ids == builder.prefix_ids + cell.input_ids[len(builder.prefix_ids):cell.question_start] + \
        builder.suffix_ids
    assert cell.needle_tokens == len(builder.needle_ids)


def test_followup_is_a_second_user_turn(builder, tokenizer):
    cell = builder.build(1000, 50, questions_per_context=2)
    for (_, question), q in zip(nd.NEEDLES, cell.questions):
        conversation = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Doc."}, {"role": "assistant", "content": "ANSWER"},
             {"role": "user", "content": f"Question: {question}"}], tokenize=False, add_generation_prompt=True)
        assert conversation.endswith("ANSWER" + tokenizer.eos_token + q["followup"])
        assert q["followup"].startswith("\n<|im_start|>user\nQuestion: ")
    plain = nd.NeedleHaystack(tokenizer, "A short text. " * 200, use_chat_template=False)
    assert plain.build(1000, 50, 2).questions[1]["followup"] == f"\nQuestion: {nd.NEEDLES[1][1]}\nAnswer:"


@pytest.mark.parametrize("k", [0, len(nd.NEEDLES) + 1, 2.0])
def test_questions_per_context_checked(builder, k):
    with pytest.raises(ValueError, match=f"the needle poses 1 to {len(nd.NEEDLES)} questions per context"):
        builder.build(1000, 50, questions_per_context=k)


def test_each_needle_scored_against_its_own_words():
    keys = [set(nd.needle_key_words(n, q)) for n, q in nd.NEEDLES]
    assert all(not (a & b) for i, a in enumerate(keys) for b in keys[i + 1:])    # no key word shared
    for j, (needle, question) in enumerate(nd.NEEDLES):
        own = nd.score_answer(needle, needle, question)
        assert own["recall"] == 1.0 and own["harness_word_recall"] == 1.0 and own["rouge1_f"] > 0.99
        other = nd.NEEDLES[(j + 1) % len(nd.NEEDLES)][0]
        assert nd.needle_recall(other, needle, question) == 0.0
    assert nd.score_answer(nd.NEEDLE) == nd.score_answer(nd.NEEDLE, nd.NEEDLE, nd.RETRIEVAL_QUESTION)
