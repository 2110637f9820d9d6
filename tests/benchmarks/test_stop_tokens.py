"""Every end of a reply is a stop, for each chat family: the generation config's eos ids, the tokenizer's eos and
the token the chat template writes after an assistant turn, on offline copies of the families' tokenizers
(tests/chat_families.py); a run records the stops it passed to generate in run_meta.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pyramidkv.generation import end_of_turn_token, end_token_ids
from pyramidkv.models.loading import generation_config
from tests.chat_families import FAMILIES, family_tokenizer_dir
from tests.conftest import save_copy, tiny_llama
from tests.helpers import longbench_data_dir

TURN_ENDS = {"llama3": "<|eot_id|>", "qwen2": "<|im_end|>", "gemma2": "<end_of_turn>", "phi3": "<|end|>",
             "mistral": "</s>"}


def _stops(folder: Path, config=None) -> set[str]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = end_token_ids(tokenizer, generation_config(str(folder), config))
    assert len(ids) == len(set(ids))
    return set(tokenizer.convert_ids_to_tokens(ids))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_end_of_a_reply_of_the_family_stops(family, tmp_path):
    from transformers import AutoTokenizer, LlamaConfig

    spec = FAMILIES[family]
    folder = family_tokenizer_dir(tmp_path / family, family)
    assert end_of_turn_token(AutoTokenizer.from_pretrained(folder)) == TURN_ENDS[family]
    assert _stops(folder) == spec["stops"]
    # without generation_config.json: the tokenizer's eos and the template's end of turn still stop (and what
    # the model config names: transformers makes the generation config from it)
    bare = family_tokenizer_dir(tmp_path / f"{family}-bare", family, generation_config=False)
    assert _stops(bare, LlamaConfig(eos_token_id=None)) == {spec["eos"], TURN_ENDS[family]}
    # without a chat template: the eos ids alone
    plain = family_tokenizer_dir(tmp_path / f"{family}-plain", family, chat_template=False, generation_config=False)
    assert end_of_turn_token(AutoTokenizer.from_pretrained(plain)) is None
    assert _stops(plain, LlamaConfig(eos_token_id=None)) == {spec["eos"]}


def test_a_template_with_no_special_token_after_the_reply_adds_none(tmp_path):
    from transformers import AutoTokenizer

    folder = family_tokenizer_dir(tmp_path / "t", "mistral")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} done {% endfor %}</s>"
    assert end_of_turn_token(tokenizer) is None           # text between the reply and </s>
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert end_of_turn_token(tokenizer) is None


def test_the_run_passes_the_families_stops_to_generate_and_records_them(tmp_path, monkeypatch):
    """A LongBench run on a tiny random Llama with Llama 3's tokenizer: generate gets <|end_of_text|> and
    <|eot_id|> (from the model's files, not from its name), run_meta.json records them."""
    import pyramidkv.generation as G
    from pyramidkv.benchmarks.longbench import run as R
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    save_copy(tiny_llama(vocab=96, max_position_embeddings=2048), model_dir)
    family_tokenizer_dir(model_dir, "llama3")        # its generation_config.json over the one the model saved
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    data = tmp_path / "data"
    data.mkdir()
    with open(longbench_data_dir() / "multi_news.jsonl", encoding="utf-8") as rows:
        (data / "multi_news.jsonl").write_text(next(rows), encoding="utf-8")
    passed = []
    real = G.generate

    def spy(*args, **kwargs):
        passed.append(kwargs["stop_token_ids"])
        return real(*args, **kwargs)

    monkeypatch.setattr(G, "generate", spy)
    save = tmp_path / "out"
    assert R.main(["--method", "fullkv", "--model_path", str(model_dir), "--device", "cpu", "--data_dir", str(data),
                   "--datasets", "multi_news", "--save_dir", str(save), "--max_new_tokens", "2"]) == 0
    expected = tokenizer.convert_tokens_to_ids(["<|end_of_text|>", "<|eot_id|>"])
    assert passed == [expected]
    meta = json.loads(next(save.rglob("run_meta.json")).read_text())
    assert meta["stop_tokens"] == {"multi_news": ["<|end_of_text|>", "<|eot_id|>"]}
    assert meta["stop_token_ids"] == {"multi_news": expected}
    # no --max_length and a name the official config lacks: the rule (window - new tokens - template tokens)
    frame = len(tokenizer.apply_chat_template([{"role": "user", "content": "what"}], add_generation_prompt=True)) - 1
    assert meta["max_length"] == {"multi_news": 2048 - 2 - frame}
    assert meta["max_length_rule"] == f"max_position_embeddings 2048 - new tokens - {frame} chat-template tokens, " \
                                      f"at most 31500"
