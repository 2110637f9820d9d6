"""Shared fixtures: the real default model (converted once per machine) and a tiny random Llama."""

from __future__ import annotations

import copy
import functools
import os

import pytest
import torch

from pyramidkv.models.default_model import default_model_path


def pytest_configure(config):
    """Under pytest-xdist (`make test`: -n auto) each worker computes on one thread, and so do the runners it
    starts: one thread per core, where torch's default (every core, in every worker) makes them wait."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The converted SmolLM2-135M-Instruct checkpoint (first use converts the GGUF, ~30 s)."""
    return str(default_model_path())


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(model, tokenizer): SmolLM2 as LlamaForCausalLM, sdpa, float32, CPU."""
    from pyramidkv import load_model

    return load_model(smollm2_path, attn_implementation="sdpa", device="cpu")


@pytest.fixture(scope="session")
def tokenizer(smollm2_path):
    """SmolLM2's tokenizer alone (no weights loaded)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


@pytest.fixture(scope="session")
def formatter(tokenizer):
    """The RULER prompt formatter for SmolLM2 (chat template, no system turn)."""
    from pyramidkv.benchmarks.ruler.generate import PromptFormatter

    return PromptFormatter(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_path) -> str:
    """A 2-layer random Llama (GQA 4 query / 2 KV heads) with SmolLM2's tokenizer, saved as an HF directory.

    For end-to-end runner tests that must take seconds: the outputs are
    meaningless but every code path (tokenizer, template, cache, patch) is real.
    """
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    save_copy(tiny_llama(vocab=len(tokenizer), **FOR_SMOLLM2_TOKENIZER), out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def eager_setup(smollm2_path):
    """(eager model, ids, attentions, keys) of a ~400-token prompt: the material of the reference tests.

    attentions: per layer the [Hq, n, n] attention probabilities transformers returns; keys: per layer
    the [Hkv, n, D] post-RoPE keys of an ordinary DynamicCache (both float64 numpy)."""
    from pyramidkv import load_model
    from tests.prompts import STORY

    model, tokenizer = load_model(smollm2_path, attn_implementation="eager", device="cpu")
    ids = tokenizer(STORY * 2, return_tensors="pt", add_special_tokens=False).input_ids
    with torch.no_grad():
        out = model(ids, output_attentions=True, use_cache=True)
    attentions = [a[0].double().numpy() for a in out.attentions]
    keys = [out.past_key_values[l][0][0].double().numpy() for l in range(len(attentions))]
    return model, ids, attentions, keys


@pytest.fixture(scope="session")
def random_llama(tokenizer, tmp_path_factory):
    """(model, tokenizer, tables): a 4-layer random Llama in memory (GQA 4 query / 2 KV heads, head_dim 16) with
    SmolLM2's tokenizer, and for it the tables the units that need one read: `head_scores` (HeadKV),
    `pattern_table` (MInference, every pattern kind on some head), `kvzap_path` (KVzap's predictor, made on it),
    `duo_pattern` (DuoAttention's gates), `qfilter_path` and `kvzip_head_path` (random calibration files).

    For properties that hold whatever the weights (a batch computes each prompt alone): a generate() takes
    milliseconds where SmolLM2's takes a second, and every code path is the same.
    """
    import json

    layers, heads = 4, 4
    model = tiny_llama(layers=layers, heads=heads, vocab=len(tokenizer), **FOR_SMOLLM2_TOKENIZER)
    config = model.config
    folder = tmp_path_factory.mktemp("random-llama-tables")
    generator = torch.Generator().manual_seed(1)
    head_scores = folder / "head_scores.json"
    head_scores.write_text(json.dumps({f"{layer}-{head}": [float(torch.rand(1, generator=generator))]
                                       for layer in range(layers) for head in range(heads)}))
    kinds = [["vertical_and_slash", 8, 16, 0.9], ["stream_llm", 4, 16, 0.9], ["block_sparse", 0, 0, 1.0]]
    patterns = folder / "patterns.json"
    patterns.write_text(json.dumps([{str(head): kinds[(layer + head) % 3] for head in range(heads)}
                                    for layer in range(layers)]))
    from tests.helpers import kvzap_artifact, write_calibrations

    kvzap = kvzap_artifact(model, folder / "kvzap-linear.safetensors")
    duo = folder / "full_attention_heads.tsv"   # DuoAttention's gates, 4 layers x 2 KV heads: 4 stream at share 0.5
    duo.write_text("0.9\t0.1\n0.2\t0.8\n0.7\t0.3\n0.1\t0.6\n")
    return model, tokenizer, {"head_scores": str(head_scores), "pattern_table": str(patterns), "kvzap_path": kvzap,
                              "duo_pattern": str(duo), **write_calibrations(folder, config)}


SHARP_STD = 0.2   # at transformers' default 0.02 attention is nearly flat: a dropped token moves no logit beyond 1e-2


@pytest.fixture(scope="session")
def sharp_llama(random_llama):
    """(model, tokenizer, tables): random_llama re-drawn with weights of std SHARP_STD, for properties checked by
    comparing outputs (the same logits, the same text) that must not hold vacuously: here a budget one token
    short of the prompt moves a decode step's logits by 0.2 or more, and greedy text depends on the prompt."""
    model, tokenizer, tables = random_llama
    config = model.config
    return tiny_llama(layers=config.num_hidden_layers, heads=config.num_attention_heads, vocab=config.vocab_size,
                      std=SHARP_STD, **FOR_SMOLLM2_TOKENIZER), tokenizer, tables


@pytest.fixture(scope="session")
def sharp_model_dir(tmp_path_factory, tiny_model_dir) -> str:
    """tiny_model_dir's Llama re-drawn with weights of std SHARP_STD, saved as an HF directory: for runner tests
    that compare predictions, which then depend on the prompt."""
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("sharp-llama")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    save_copy(tiny_llama(vocab=len(tokenizer), std=SHARP_STD, **FOR_SMOLLM2_TOKENIZER), out)
    tokenizer.save_pretrained(out)
    return str(out)


# ---- tiny random models: one cached factory ---------------------------------------------------------------------
# Not a fixture, so that module-level code and helpers reach it too: `from tests.conftest import tiny_llama`.

@functools.lru_cache(maxsize=None)
def tiny_llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 96, std: float = 0.02,
               attn: str | None = "sdpa", seed: int = 0, family: str = "llama", **config):
    """A random eval model, hidden 64 (head_dim 16 with 4 heads), MLP 128, 512 positions: `layers` layers of
    `heads` query and `kv_heads` KV heads, `vocab` tokens, weights of std `std` drawn after torch.manual_seed(seed)
    (torch's global generator is left as it was), attention `attn` (None: transformers' choice). `family`: a
    model_type of MODEL_GLUE, built in its config class; `config`: any other config setting, over these.

    Cached by its settings (they must be hashable) and shared by every test that asks for the same: never change
    its weights or its config; copy it first (copy.deepcopy; save_copy to save it, as save_pretrained writes into
    the config). `tiny_llama.__wrapped__(...)` builds a fresh one."""
    from pyramidkv.models.patch import MODEL_GLUE

    glue = MODEL_GLUE[family]
    settings = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
                    initializer_range=std)
    model_config = glue.config_class(**{**settings, **config}, attn_implementation=attn)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return glue.causal_lm(model_config).eval()


def save_copy(model, folder) -> None:
    """Save a copy of `model` as an HF directory (save_pretrained sets config.architectures and torch_dtype:
    a cached tiny_llama stays as it was)."""
    copy.deepcopy(model).save_pretrained(folder, safe_serialization=True)


# The tiny Llamas that run with SmolLM2's tokenizer (random_llama, tiny_model_dir): its special token ids, its
# rope_theta, tied embeddings (vocab=len(tokenizer) is given with them).
FOR_SMOLLM2_TOKENIZER = dict(max_position_embeddings=8192, rope_theta=100000.0, tie_word_embeddings=True,
                             bos_token_id=1, eos_token_id=2, pad_token_id=2)
