"""The per-model tables (HeadKV head scores, MInference patterns) for any family of MODEL_GLUE: the scripts that
make them run on a tiny random non-Llama model, the attention the pattern search measures is the model's own,
and a method whose table is missing is refused in one line that names the model and the command that makes it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pyramidkv.models.patch import MODEL_GLUE
from tests.helpers import ROOT, load_script
from tests.models.families import tiny_family

HEAD_SCORES = load_script("head_scores", ROOT / "scripts" / "head_scores.py")
PATTERNS = load_script("minference_patterns", ROOT / "scripts" / "minference_patterns.py")


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory, smollm2_path) -> str:
    """A 2-layer random Mistral (GQA 4 / 2, head_dim 16) with SmolLM2's tokenizer, saved as an HF folder."""
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    out = tmp_path_factory.mktemp("tiny-mistral")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    torch.manual_seed(0)
    MistralForCausalLM(MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     max_position_embeddings=8192, sliding_window=None, tie_word_embeddings=True,
                                     bos_token_id=1, eos_token_id=2)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("model_type", sorted(MODEL_GLUE))
def test_the_pattern_search_measures_the_models_own_attention(model_type):
    """dense_probs (scale, soft-cap, window from the glue) against the attention weights the unpatched eager model
    returns, on every row of MODEL_GLUE."""
    glue = MODEL_GLUE[model_type]
    model = tiny_family(model_type, "eager")
    n, rows_from = 40, 25
    ids = torch.randint(0, 96, (1, n), generator=torch.Generator().manual_seed(1))
    queries, keys = PATTERNS.layer_qk(model, ids)
    with torch.no_grad():
        own = model(ids, output_attentions=True, use_cache=False).attentions      # layers x [1, Hq, n, n]
    for layer, (q, k) in enumerate(zip(queries, keys)):
        probs = PATTERNS.dense_probs(glue, model, layer, q.double(), k.double(), rows_from)
        torch.testing.assert_close(probs.float(), own[layer][0, :, rows_from:], rtol=1e-4, atol=1e-5)


def test_the_scripts_make_both_tables_for_a_mistral(tiny_mistral, tmp_path, monkeypatch):
    from pyramidkv.allocation.head_tables import load_head_scores
    from pyramidkv.sparse_prefill.tables import check_table_shape, load_pattern_table

    monkeypatch.setattr(sys, "argv", ["script"])
    # seconds, not 16: a shorter prompt and two of the six candidates (the script's path is the same)
    monkeypatch.setattr(PATTERNS, "MIN_CONTEXT_LENGTH", 256)
    monkeypatch.setattr(PATTERNS, "CANDIDATES", PATTERNS.CANDIDATES[:2])
    patterns = tmp_path / "patterns.json"
    PATTERNS.main(["--model_path", tiny_mistral, "--out", str(patterns), "--context_length", "400"])
    check_table_shape(load_pattern_table(patterns), 2, 4, patterns)

    haystack = tmp_path / "haystack"
    haystack.mkdir()
    (haystack / "essay.txt").write_text("The river runs past the old mill and the town square. " * 80)
    heads = tmp_path / "heads.json"
    HEAD_SCORES.main(["--model_path", tiny_mistral, "--out", str(heads), "--num_probes", "1", "--context_lengths",
                      "300", "--haystack_dir", str(haystack), "--keep_unanswered", "--device", "cpu"])
    assert load_head_scores(heads).shape == (2, 4)
    assert json.loads(heads.read_text().splitlines()[1])["run_meta"]["model"] == tiny_mistral


@pytest.mark.parametrize("method, says", [
    (["--method", "headkv", "--max_capacity_prompts", "64"],
     "no reasoning head-score table for this model ({model!r}; packaged: smollm2-135m); compute one with `python "
     "scripts/head_scores.py --model_path {model} --kind reasoning --out FILE`"),
    (["--method", "minference"],
     "no packaged MInference pattern table for this model ({model!r}; packaged: smollm2-135m); write one with "
     "`python scripts/minference_patterns.py --model_path {model} --out FILE`")])
def test_a_missing_table_is_refused_in_one_line_with_the_command_that_makes_it(method, says, tiny_mistral, tmp_path,
                                                                                capsys):
    from pyramidkv.benchmarks.longbench import run as R

    with pytest.raises(SystemExit) as exit_:
        R.main([*method, "--model_path", tiny_mistral, "--device", "cpu", "--save_dir", str(tmp_path),
                "--print_run_dir"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("run_longbench.py: error: "), err
    assert says.format(model=tiny_mistral) in err, err
