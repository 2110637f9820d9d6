"""Needle in a haystack: grid, haystack loading, sentence ends, needle placement, prompt length, scoring."""

from __future__ import annotations

import re

import pytest

from pyramidkv.benchmarks import needle as nd

LENGTHS = (1000, 2500, 4000)
DEPTHS = (0, 10, 33, 50, 77, 100)
NEEDLE_LINE = "\nThe best thing to do in San Francisco is eat a sandwich and sit in Dolores Park on a sunny day.\n"
# Text that ends a sentence: . ! or ? then optional closing quotes/brackets (checked after rstrip()).
SENTENCE_END = re.compile(r"[.!?][\"')\]}\u201d\u2019]*$")


@pytest.fixture(scope="module")
def builder(tokenizer):
    b = nd.NeedleHaystack(tokenizer, nd.load_haystack_text())
    b.prepare(max(LENGTHS))
    return b


# --- grid ----------------------------------------------------------------------------------------

def test_depths_and_lengths():
    assert nd.depth_percents(10) == [0, 11, 22, 33, 44, 56, 67, 78, 89, 100]
    assert nd.depth_percents(5) == [0, 25, 50, 75, 100]
    assert nd.depth_percents(2) == [0, 100]
    assert nd.context_lengths(1000, 4000, 1000) == [1000, 2000, 3000, 4000]
    assert nd.context_lengths(1000, 3500, 1000) == [1000, 2000, 3000]
    assert nd.context_lengths(500, 500, 7) == [500]
    with pytest.raises(ValueError, match="s_len"):
        nd.context_lengths(4000, 1000, 1000)
    with pytest.raises(ValueError, match="step"):
        nd.context_lengths(1000, 4000, 0)
    with pytest.raises(ValueError):
        nd.depth_percents(0)


# --- haystack -----------------------------------------------------------------------------------

def test_default_haystack_is_the_paul_graham_essays():
    folder = nd.default_haystack_dir()
    assert folder.name == "PaulGrahamEssays" and len(list(folder.glob("*.txt"))) >= 40
    assert len(nd.load_haystack_text()) > 500_000


def test_haystack_dir_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        nd.load_haystack_text(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .txt"):
        nd.load_haystack_text(tmp_path / "empty")


def test_short_custom_haystack_is_repeated(tmp_path, tokenizer):
    (tmp_path / "b.txt").write_text("Second file. It is short.", encoding="utf-8")
    (tmp_path / "a.txt").write_text("First file here. Cats sleep a lot.", encoding="utf-8")
    text = nd.load_haystack_text(tmp_path)
    assert text.index("First file") < text.index("Second file")   # file-name order
    b = nd.NeedleHaystack(tokenizer, text)
    sample = b.build(600, 50)
    assert sample.context_tokens <= 600 - nd.CONTEXT_BUFFER
    assert sample.haystack_tokens > 300   # the 17-token text was repeated to fill the budget


# --- sentence ends from decoded text --------------------------------------------------------------

def test_sentence_ends_from_decoded_text(tokenizer):
    text = "It costs 3.5 dollars. Really? Yes!\nNew line"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    ends = nd.sentence_ends(tokenizer, ids)
    # Text up to each end: dollars. / Really? / Yes!; "3." (followed by "5") is not an end, nor is the
    # unfinished last line.
    prefixes = [tokenizer.decode(ids[: i + 1]) for i, e in enumerate(ends) if e]
    assert prefixes == ["It costs 3.5 dollars.", "It costs 3.5 dollars. Really?", "It costs 3.5 dollars. Really? Yes!"]


def test_line_break_is_not_a_sentence_end(tokenizer):
    """Issue 12: hard-wrapped text breaks lines inside sentences; only . ! ? + whitespace end one."""
    text = "The cat sat on\nthe mat. Dogs bark at\nnight!\nDo fish\nsleep? He said \"stop.\" Then\nleft"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    prefixes = [tokenizer.decode(ids[: i + 1]) for i, e in enumerate(nd.sentence_ends(tokenizer, ids)) if e]
    assert prefixes == ["The cat sat on\nthe mat.",
                        "The cat sat on\nthe mat. Dogs bark at\nnight!",
                        "The cat sat on\nthe mat. Dogs bark at\nnight!\nDo fish\nsleep?",
                        "The cat sat on\nthe mat. Dogs bark at\nnight!\nDo fish\nsleep? He said \"stop.\""]


# A hand-made hard-wrapped haystack: every sentence has a line break inside it.
WRAPPED_SENTENCES = ("Cats sleep for most of\nthe day.", "Dogs like long walks in\nthe park!",
                     "Do owls hunt late at\nnight?", "Fish swim.")
WRAPPED_ENDS = ("the day.", "the park!", "night?", "Fish swim.")
WRAPPED_STARTS = (" Dogs", " Do owls", " Fish", "\n\nCats")   # what can follow a sentence end


@pytest.mark.parametrize("length", (120, 333, 500))
def test_needle_lands_between_sentences_of_wrapped_text(tokenizer, length):
    """Issue 12 on a hand-made haystack: the needle goes after a whole sentence, never after a line break
    inside one, at most one sentence before the requested offset; the document ends on a sentence end."""
    b = nd.NeedleHaystack(tokenizer, " ".join(WRAPPED_SENTENCES), buffer=0, use_chat_template=False)
    for depth in range(0, 101, 5):
        s = b.build(length, depth)
        context = s.input_ids[s.prefix_tokens: s.prefix_tokens + s.context_tokens]
        hay = context[: s.needle_start] + context[s.needle_start + s.needle_tokens:]
        before, after = tokenizer.decode(hay[: s.needle_start]), tokenizer.decode(hay[s.needle_start:])
        assert tokenizer.decode(context) == before + NEEDLE_LINE + after
        assert before == "" or before.endswith(WRAPPED_ENDS), (depth, before[-40:])
        assert after == "" or after.startswith(WRAPPED_STARTS if before else "Cats"), (depth, after[:40])
        assert tokenizer.decode(hay).endswith(WRAPPED_ENDS)
        requested = int(s.haystack_tokens * depth / 100)
        skipped = tokenizer.decode(hay[s.needle_start: requested])
        assert s.needle_start <= requested and not any(end in skipped for end in WRAPPED_ENDS), (depth, skipped)


def test_essay_needles_and_haystack_ends_on_sentence_ends(tokenizer):
    """Issue 12 on the shipped essays (hard-wrapped at ~70 characters): 1000..8000 tokens x 10 depths."""
    b = nd.NeedleHaystack(tokenizer, nd.load_haystack_text())
    b.prepare(8000)
    mid_sentence, hay_mid_sentence = [], []
    for length in range(1000, 8001, 500):
        for depth in nd.depth_percents(10):
            s = b.build(length, depth)
            hay = b._ids[: s.haystack_tokens]
            before = tokenizer.decode(hay[: s.needle_start])
            follows = tokenizer.decode(hay[s.needle_start: s.needle_start + 1])
            whitespace_after = before[-1:].isspace() or follows[:1].isspace() or follows == ""   # "": the end
            if before and not (SENTENCE_END.search(before.rstrip()) and whitespace_after):
                mid_sentence.append((length, depth, before[-30:] + "|" + follows))
        if not SENTENCE_END.search(tokenizer.decode(hay).rstrip()):
            hay_mid_sentence.append(length)
    assert mid_sentence == [] and hay_mid_sentence == []


# --- placement and length -----------------------------------------------------------------------

def _sentence_starts(builder, hay_len):
    return [0] + [i + 1 for i in range(hay_len) if builder._ends[i]]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("depth", DEPTHS)
def test_needle_at_requested_depth(builder, tokenizer, length, depth):
    s = builder.build(length, depth)
    context = s.input_ids[s.prefix_tokens: s.prefix_tokens + s.context_tokens]
    # The needle is where the sample says, whole.
    assert context[s.needle_start: s.needle_start + s.needle_tokens] == builder.needle_ids
    assert tokenizer.decode(builder.needle_ids) == NEEDLE_LINE
    hay = context[: s.needle_start] + context[s.needle_start + s.needle_tokens:]
    assert hay == builder._ids[: s.haystack_tokens]
    # It starts after a sentence end (checked on the decoded text, not only the helper's flags).
    if s.needle_start > 0:
        assert SENTENCE_END.search(tokenizer.decode(hay[: s.needle_start]))
    # It is at the last sentence start at or before the requested token offset: within one sentence.
    requested = int(s.haystack_tokens * depth / 100)
    starts = [p for p in _sentence_starts(builder, s.haystack_tokens) if p <= requested]
    assert s.needle_start == starts[-1]
    longest = max(b - a for a, b in zip(_sentence_starts(builder, s.haystack_tokens),
                                        _sentence_starts(builder, s.haystack_tokens)[1:]))
    assert 0 <= requested - s.needle_start <= longest
    assert abs(s.needle_start / s.haystack_tokens - depth / 100) <= longest / s.haystack_tokens
    if depth == 0:
        assert s.needle_start == 0
    if depth == 100:
        assert s.needle_start == s.haystack_tokens   # the document ends on a sentence end; needle last


@pytest.mark.parametrize("length", (400, 1000, 2500, 4000, 8000))
def test_context_length_respected(builder, tokenizer, length):
    prompt_only = nd.NeedleHaystack(tokenizer, builder.text, length_budget="prompt")
    for depth in (0, 50, 100):
        # Default ("context", the reference): haystack + needle fill length - 200, the template comes on top.
        s = builder.build(length, depth)
        assert length - nd.CONTEXT_BUFFER - 150 <= s.context_tokens <= length - nd.CONTEXT_BUFFER
        assert s.prompt_tokens == len(s.input_ids) == s.prefix_tokens + s.context_tokens + len(builder.suffix_ids)
        assert s.prompt_tokens <= builder.max_prompt_tokens(length) == length - nd.CONTEXT_BUFFER + 68
        # "prompt": the whole prompt, template included, fills length - 200.
        p = prompt_only.build(length, depth)
        assert length - nd.CONTEXT_BUFFER - 150 <= p.prompt_tokens <= length - nd.CONTEXT_BUFFER
        assert prompt_only.max_prompt_tokens(length) == length - nd.CONTEXT_BUFFER


def test_needle_own_line_and_context_budget_hand_worked(tokenizer):
    """Issue 13, hand-worked: "Fish swim." is 3 tokens ('Fish'/' Fish', ' swim', '.'); the needle on its own
    line is 25 ('\n', 'The', ' best', ..., ' day', '.', '\n'). L = 1000: the context gets 1000 - 200 = 800
    tokens, the needle 25 of them, leaving 775 for the haystack, cut back to a whole sentence: 774 (258 x 3).
    Depth 50 asks for token 387 = 129 sentences, depth 10 for token 77, moved back to 75 (25 sentences)."""
    b = nd.NeedleHaystack(tokenizer, " ".join(["Fish swim."] * 400), use_chat_template=False)
    assert len(b.needle_ids) == 25
    for depth, start in ((0, 0), (10, 75), (50, 387), (100, 774)):
        s = b.build(1000, depth)
        assert (s.haystack_tokens, s.context_tokens, s.needle_start) == (774, 799, start)
        assert s.prompt_tokens == 799 + b.template_tokens > 800          # the template comes on top
        text = tokenizer.decode(s.input_ids[s.prefix_tokens: s.prefix_tokens + s.context_tokens])
        expected_before = " ".join(["Fish swim."] * (start // 3))
        expected_after = " ".join(["Fish swim."] * (258 - start // 3))
        if 0 < start < 774:
            expected_after = " " + expected_after
        assert text == expected_before + NEEDLE_LINE + expected_after
    # The previous layout stays available: the whole prompt within L - 200.
    p = nd.NeedleHaystack(tokenizer, " ".join(["Fish swim."] * 400), use_chat_template=False,
                          length_budget="prompt").build(1000, 50)
    assert 800 - 3 < p.prompt_tokens <= 800


def test_length_budget_and_window_errors(builder, tokenizer):
    with pytest.raises(ValueError, match=r"length_budget must be one of context, prompt; got 'whole'"):
        nd.NeedleHaystack(tokenizer, "Some text.", length_budget="whole")
    # Context budget: the template does not count, so buffer + needle + 1 haystack token is the minimum.
    assert builder.min_context_length() == 200 + 25 + 1
    prompt_only = nd.NeedleHaystack(tokenizer, builder.text, length_budget="prompt")
    assert prompt_only.min_context_length() == 200 + 68 + 25 + 1
    for b in (builder, prompt_only):
        with pytest.raises(ValueError, match="too short"):
            b.build(b.min_context_length() - 1, 50)
        b.build(b.min_context_length(), 50)
        with pytest.raises(ValueError, match=rf"--s_len {b.min_context_length() - 1} is too short"):
            b.check_context_lengths(b.min_context_length() - 1, 4000)
    # The prompt (+ the answer) never exceeds the model's window: 8192 - 200 + 68 = 8060 prompt tokens + 100 fit,
    # + 200 do not (the longest e_len is then 8192 - 200 - 68 + 200 = 8124).
    builder.check_context_lengths(1000, 8192, window=8192, max_new_tokens=100)
    with pytest.raises(ValueError, match=r"--e_len 8192: .*8060 tokens.*context window \(8192\); use --e_len <= 8124"):
        builder.check_context_lengths(1000, 8192, window=8192, max_new_tokens=200)
    prompt_only.check_context_lengths(1000, 8192, window=8192, max_new_tokens=200)


def test_prompt_uses_chat_template_and_question(builder, tokenizer):
    s = builder.build(1000, 50)
    text = tokenizer.decode(s.input_ids)
    assert text.startswith("<|im_start|>system")
    assert text.rstrip().endswith("<|im_start|>assistant")
    assert f"Question: {nd.RETRIEVAL_QUESTION}" in text
    assert nd.NEEDLE in text


def test_plain_prompt_without_chat_template(tokenizer):
    b = nd.NeedleHaystack(tokenizer, nd.load_haystack_text(), use_chat_template=False, answer_prefix="The answer is")
    s = b.build(800, 25)
    text = tokenizer.decode(s.input_ids)
    assert "<|im_start|>" not in text
    assert text.endswith("Answer: The answer is")
    assert s.context_tokens <= 600


# --- scoring ------------------------------------------------------------------------------------

def test_rouge1_f_hand_worked():
    # rouge 1.0.1 counts distinct unigrams, case-sensitive. The needle has 21 words, 19 distinct
    # ("in" and "a" twice; "day." -> "day" as the package splits sentences at periods).
    assert nd.rouge1_f(nd.NEEDLE) == pytest.approx(1.0, abs=1e-6)
    # "eat a sandwich": P = 3/3, R = 3/19, F = 2PR/(P+R) = 6/22.
    assert nd.rouge1_f("eat a sandwich") == pytest.approx(6 / 22, abs=1e-6)
    # Case matters in the published variant: "Eat" does not match "eat". P = 2/3, R = 2/19 -> F = 4/22 = 2/11.
    assert nd.rouge1_f("Eat a sandwich") == pytest.approx(2 / 11, abs=1e-6)
    # Nothing in common, empty, and only punctuation (the package raises) score 0.
    assert nd.rouge1_f("Paris was nice") == 0.0
    assert nd.rouge1_f("") == 0.0
    assert nd.rouge1_f("...") == 0.0


def test_needle_recall_hand_worked():
    assert nd.needle_key_words() == ["eat", "sandwich", "sit", "dolores", "park", "sunny", "day"]
    assert nd.needle_recall(nd.NEEDLE) == 1.0
    assert nd.needle_recall("eat a sandwich") == pytest.approx(2 / 7)
    assert nd.needle_recall("SIT IN DOLORES PARK!") == pytest.approx(3 / 7)       # case-insensitive
    # Repeating the question finds nothing.
    assert nd.needle_recall("The best thing to do in San Francisco is to visit.") == 0.0
    assert nd.needle_recall("") == 0.0
    # Without a question, every content word of the needle counts (11 of them).
    assert nd.needle_key_words(question=None)[:4] == ["best", "thing", "san", "francisco"]
    assert nd.needle_recall("best thing", question=None) == pytest.approx(2 / 11)


def test_harness_rouge1_x10_hand_worked():
    """Issue 14: the public harness's score, rouge_score ROUGE-1 F (Porter stemming, lowercased, unigram
    counts) x 10. The needle has 21 tokens ("in" and "a" twice)."""
    # "Eating sandwiches, sitting." stems to eat, sandwich, sit: P = 3/3, R = 3/21, F = 2PR/(P+R) = 1/4.
    assert nd.harness_rouge1_x10("Eating sandwiches, sitting.") == pytest.approx(2.5)
    # Case does not matter: "EAT A SANDWICH" -> P = 1, R = 3/21 -> 2.5 (ours, case-sensitive, scores it 0).
    assert nd.harness_rouge1_x10("EAT A SANDWICH") == pytest.approx(2.5)
    assert nd.rouge1_f("EAT A SANDWICH") == 0.0
    # Counts, not sets: "a a a" matches the needle's two "a": P = 2/3, R = 2/21, F = (8/63)/(16/21) = 1/6.
    assert nd.harness_rouge1_x10("a a a") == pytest.approx(10 / 6)
    assert nd.harness_rouge1_x10(nd.NEEDLE) == pytest.approx(10.0)
    assert nd.harness_rouge1_x10("") == 0.0 and nd.harness_rouge1_x10("...") == 0.0


@pytest.mark.parametrize("answer", ["The best thing to do in San Francisco is eat a sandwich and sit in Dolores Park.",
                                    "Go to Dolores Park on sunny days and eat sandwiches.", "Paris", "day"])
def test_harness_rouge1_x10_matches_rouge_score(answer):
    """Same value as the rouge_score package called the way the harness calls it (its needle has line breaks)."""
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rougeL"], use_stemmer=True)
    expected = scorer.score(NEEDLE_LINE, answer)["rouge1"].fmeasure * 10
    assert nd.harness_rouge1_x10(answer) == pytest.approx(expected, abs=1e-12)


def test_harness_word_recall_hand_worked():
    """Issue 14: the harness heatmap's score: distinct lowercased whitespace-split words of "eat a sandwich and
    sit in Dolores Park on a sunny day." (11: eat a sandwich and sit in dolores park on sunny day.) found in
    the answer's words."""
    assert nd.harness_word_recall(nd.NEEDLE) == 1.0
    assert nd.harness_word_recall("EAT a sandwich and sit in dolores park on a sunny day.") == 1.0
    # "sandwich." keeps its period, so it is not "sandwich": eat, a -> 2/11.
    assert nd.harness_word_recall("Eat a sandwich.") == pytest.approx(2 / 11)
    # "day" without the period does not count; "sunny" does -> 1/11.
    assert nd.harness_word_recall("sunny day") == pytest.approx(1 / 11)
    # Restating the question still earns "in" -> 1/11; nothing -> 0.
    assert nd.harness_word_recall("The best thing to do in San Francisco is") == pytest.approx(1 / 11)
    assert nd.harness_word_recall("") == 0.0


def test_score_answer_has_every_score():
    scores = nd.score_answer("Eat a sandwich.")
    assert scores == {"rouge1_f": nd.rouge1_f("Eat a sandwich."), "recall": pytest.approx(2 / 7),
                      "harness_rouge1_x10": pytest.approx(2.5), "harness_word_recall": pytest.approx(2 / 11)}
