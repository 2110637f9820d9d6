"""Every bad input gets a clear error naming the bad value and what is allowed."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from transformers import DynamicCache, GPT2Config, GPT2LMHeadModel

from pyramidkv import compress, load_model, make_method
from pyramidkv.models.patch import MODEL_GLUE
from pyramidkv.runner.results import read_jsonl
from tests.prompts import STORY


def test_unknown_method():
    with pytest.raises(ValueError, match=r"unknown method 'snapkvv'.*fullkv.*snapkv"):
        make_method("snapkvv", budget=128)


def test_setting_the_method_does_not_have():
    with pytest.raises(ValueError, match=r"beta is a setting of the layer allocation pyramid, not of uniform"):
        make_method("snapkv", budget=128, beta=20)
    with pytest.raises(ValueError, match=r"snapkv has no setting 'betta'; its settings are: budget, .*kernel_size"):
        make_method("snapkv", budget=128, betta=20)


@pytest.mark.parametrize("budget", [0, -3])
def test_budget_below_one(budget):
    with pytest.raises(ValueError, match=r"budget \(max_capacity_prompts\) must be an integer >= 1"):
        make_method("snapkv", budget=budget, window_size=0)


@pytest.mark.parametrize("budget", [True, 2.5, "128"])
def test_budget_not_an_integer(budget):
    with pytest.raises(ValueError, match=r"snapkv: budget \(max_capacity_prompts\) must be an integer, got "):
        make_method("snapkv", budget=budget, window_size=0)


def test_budget_smaller_than_window():
    with pytest.raises(ValueError, match=r"budget \(max_capacity_prompts\) 16 is smaller than window_size 32"):
        make_method("h2o", budget=16)


@pytest.mark.parametrize("ratio", [0.0, -0.1, 1.5])
def test_ratio_out_of_range(ratio):
    with pytest.raises(ValueError, match=r"budget_ratio .* must be in \(0, 1\]"):
        make_method("snapkv", budget_ratio=ratio)


def test_budget_missing_or_doubled_or_given_to_fullkv():
    with pytest.raises(ValueError, match="needs exactly one of budget"):
        make_method("snapkv")
    with pytest.raises(ValueError, match="needs exactly one of budget"):
        make_method("snapkv", budget=128, budget_ratio=0.5)
    with pytest.raises(ValueError, match="fullkv keeps every token; it takes no budget"):
        make_method("fullkv", budget=128)


def test_bad_method_settings():
    with pytest.raises(ValueError, match="kernel_size must be a positive odd integer, got 4"):
        make_method("snapkv", budget=128, kernel_size=4)
    with pytest.raises(ValueError, match="pooling must be 'max' or 'avg', got 'mean'"):
        make_method("snapkv", budget=128, pooling="mean")
    with pytest.raises(ValueError, match="gqa_layout must be one of kv_head|query_head, got 'heads'"):
        make_method("snapkv", budget=128, gqa_layout="heads")
    with pytest.raises(ValueError, match="gqa_reduce must be one of mean|max|sum"):
        make_method("snapkv", budget=128, gqa_reduce="median")
    with pytest.raises(ValueError, match="budget 4 must exceed num_sinks 4"):
        make_method("streamingllm", budget=4)
    with pytest.raises(ValueError, match="beta must be >= 1"):
        make_method("pyramidkv", budget=128, beta=0.5)


def test_budget_equal_to_window_keeps_exactly_the_window(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids
    n = ids.shape[1]
    with compress(model, make_method("snapkv", budget=16, window_size=16)) as patch:
        cache = patch.new_cache()
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
    for layer in range(model.config.num_hidden_layers):
        for positions in cache.kept_positions(layer):
            assert positions.tolist() == list(range(n - 16, n))


def test_unknown_model_type(tmp_path):
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=50))
    with pytest.raises(ValueError, match=rf"unsupported model type 'gpt2'; supported: {', '.join(MODEL_GLUE)}$"):
        compress(model, make_method("fullkv"))
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"unsupported model type 'gpt2'"):
        load_model(str(tmp_path), device="cpu")


def test_missing_model_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "no-such-model"), device="cpu")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        load_model(str(tmp_path), device="cpu")


def test_malformed_jsonl_names_file_and_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"a": 1}) + "\n" + '{"a": 2,\n')
    with pytest.raises(ValueError, match=r"rows.jsonl:2: malformed JSON line"):
        read_jsonl(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"rows.jsonl:1: expected a JSON object"):
        read_jsonl(path)


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed here")
def test_flash_attention_requested_but_absent(smollm2_path):
    with pytest.raises(ImportError, match=r"flash-attn.*use --attn_implementation sdpa"):
        load_model(smollm2_path, attn_implementation="flash_attention_2", device="cpu")


def test_unknown_attention_implementation_and_device(smollm2_path):
    with pytest.raises(ValueError, match=r"unknown attn_implementation 'flash'; choose one of eager, sdpa"):
        load_model(smollm2_path, attn_implementation="flash", device="cpu")
    with pytest.raises(ValueError, match=r"unknown device 'tpu'"):
        load_model(smollm2_path, device="tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            load_model(smollm2_path, device="cuda")


def test_right_padding_is_refused(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids[:, :20]
    mask = torch.ones_like(ids)
    mask[:, -3:] = 0
    with compress(model, make_method("fullkv")):
        with pytest.raises(ValueError, match="not left-padded.*padding_side = 'left'"):
            model(ids, attention_mask=mask, use_cache=True)


def test_prefilled_foreign_cache_is_refused(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids[:, :20]
    with torch.no_grad():
        cache = model(ids, past_key_values=DynamicCache(), use_cache=True).past_key_values
    with compress(model, make_method("fullkv")):
        with pytest.raises(ValueError, match="cannot continue from a prefilled DynamicCache"):
            model(ids[:, :1], past_key_values=cache, use_cache=True)


def test_patching_twice_is_refused(smollm2):
    model, _ = smollm2
    with compress(model, make_method("fullkv")):
        with pytest.raises(RuntimeError, match="already patched"):
            compress(model, make_method("fullkv"))
