"""Q-Filters: the calibrated filters against a float64 SVD of the post-RoPE queries computed here from the unpatched
model (the authors' majority sign rule included, and a case it flips), the kept sets against the top-k of -<f, k>
on the model's own cached keys, calibration determinism and speed, and the refusal of another model's file."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig

from pyramidkv import compress, make_method
from pyramidkv.methods.calibrated import model_record, save_artifact
from pyramidkv.models.line import CACHE_ARGUMENT
from pyramidkv.models.patch import model_shape
from tests.conftest import tiny_llama
from tests.helpers import ROOT, load_script

CALIBRATE = load_script("calibrate_qfilter", ROOT / "scripts" / "calibrate_qfilter.py")
TEXTS, LENGTH = 2, 24


def tiny_model(layers: int = 2):
    """A random Llama of `layers` layers (GQA 4 / 2, head_dim 16), weights of std 0.2: shared, never changed."""
    return tiny_llama(layers=layers, vocab=96, std=0.2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny():
    """(model, texts): a 2-layer random Llama (GQA 4 / 2, head_dim 16) and two texts of LENGTH tokens."""
    model = tiny_model()
    texts = torch.randint(3, 96, (TEXTS, LENGTH), generator=torch.Generator().manual_seed(1)).tolist()
    return model, texts


def reference_queries(model, tokens: list[int]) -> list[np.ndarray]:
    """Per layer [Hq, n, D] float64: the layer's input (output_hidden_states), its norm, q_proj, and RoPE written out
    here (cos/sin from the module's rotary table, the half rotation by hand)."""
    with torch.no_grad():
        hidden = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        positions = torch.arange(len(tokens))[None]
        out, heads = [], model.config.num_attention_heads
        for layer, h in zip(model.model.layers, hidden):
            attention = layer.self_attn
            q = attention.q_proj(layer.input_layernorm(h)).view(1, len(tokens), heads, -1).transpose(1, 2)
            rotary = getattr(attention, "rotary_emb", None) or model.model.rotary_emb   # 4.44.2: per layer; 5.x: model
            cos, sin = rotary(q, positions)
            q, cos, sin = q[0].double().numpy(), cos[0].double().numpy(), sin[0].double().numpy()
            half = q.shape[-1] // 2
            rotated = np.concatenate([-q[..., half:], q[..., :half]], axis=-1)
            out.append(q * cos + rotated * sin)
    return out


def reference_filter(samples: np.ndarray) -> np.ndarray:
    u, _, vt = np.linalg.svd(samples, full_matrices=False)
    sign = 1.0 if (u[:, 0] > 0).sum() > samples.shape[0] / 2 else -1.0
    return -sign * vt[0]


def test_filters_equal_a_float64_svd_of_the_post_rope_queries(tiny):
    """Every position kept (num_svd_samples above the pool): each KV head's filter is the mean over its query group
    of -s v1, same direction and same sign."""
    model, texts = tiny
    got = CALIBRATE.calibrate(model, texts, num_svd_samples=10_000, seed=0).double().numpy()   # [L, Hkv, D]
    per_text = [reference_queries(model, tokens) for tokens in texts]
    config = model.config
    group = config.num_attention_heads // config.num_key_value_heads
    for layer in range(config.num_hidden_layers):
        heads = [reference_filter(np.concatenate([q[layer][h] for q in per_text]))
                 for h in range(config.num_attention_heads)]
        expected = np.stack(heads).reshape(config.num_key_value_heads, group, -1).mean(1)
        for kv in range(config.num_key_value_heads):
            cos = got[layer, kv] @ expected[kv] / np.linalg.norm(got[layer, kv]) / np.linalg.norm(expected[kv])
            assert cos > 1 - 1e-6, (layer, kv, cos)
        np.testing.assert_allclose(got[layer], expected, atol=1e-4)


@pytest.mark.parametrize("flip", [1.0, -1.0])
def test_the_sign_is_the_samples_majority_on_u1(flip):
    """70 samples at +1 along e1, 30 at -3: the mean leans to -e1 but the majority to +e1, so the filter is -e1
    (and +e1 for the mirrored samples); a sign taken from the mean, or SVD's own, would give the other."""
    generator = torch.Generator().manual_seed(0)
    samples = torch.cat([torch.full((70,), 1.0), torch.full((30,), -3.0)])[:, None] * torch.eye(8)[0]
    samples = flip * (samples + 0.01 * torch.randn(100, 8, generator=generator))
    direction = CALIBRATE.head_filter(samples)
    assert samples.mean(0)[0] * flip < 0
    np.testing.assert_allclose(direction.numpy(), -flip * torch.eye(8)[0].numpy(), atol=1e-3)


def filters_file(folder, model, texts, **record) -> str:
    filters = CALIBRATE.calibrate(model, texts, num_svd_samples=32, seed=0)
    made = {"kind": "qfilter", "model": model_record(str(folder / "none"), model.config), **record}
    return str(save_artifact(folder / "filters.safetensors", {"filters": filters}, made))


@pytest.mark.parametrize("layout", ["kv_head", "query_head"])
def test_kept_sets_are_the_top_k_of_minus_f_dot_k(tiny, tmp_path, layout):
    """Each stored head keeps the window and the budget - window best -<f, k> of the rest, on the keys the unpatched
    model caches (after RoPE); the query_head layout reads its KV head's filter."""
    model, texts = tiny
    path = filters_file(tmp_path, model, texts)
    window, budget = 4, 12
    method = make_method("qfilter", budget=budget, window_size=window, qfilter_path=path, gqa_layout=layout)
    prompt = torch.randint(3, 96, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        plain = model(prompt, use_cache=True).past_key_values
        keys = [(plain.layers[l].keys if hasattr(plain, "layers") else plain[l][0])[0].double()    # [Hkv, n, D]
                for l in range(model.config.num_hidden_layers)]
        with compress(model, method) as patch:
            cache = patch.new_cache()
            model(prompt, use_cache=True, **{CACHE_ARGUMENT: cache})
    f = load_file(path)["filters"].double()   # read back independently of the method
    n = prompt.shape[1]
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, k in enumerate(keys):
        scores = -(k @ f[layer][:, :, None])[..., 0]                                              # [Hkv, n]
        if layout == "query_head":
            scores = scores.repeat_interleave(group, 0)
        kept = cache.kept_positions(layer)
        assert len(kept) == scores.shape[0]
        for head, positions in enumerate(kept):
            best = torch.topk(scores[head, :n - window], budget - window).indices.tolist()
            assert sorted(positions.tolist()) == sorted(best + list(range(n - window, n))), (layer, head)


def test_calibration_is_seeded_and_takes_seconds(tiny):
    """Same seed: the same bytes; another seed: other samples (num_svd_samples below the pool), so other filters."""
    model, texts = tiny
    started = time.process_time()
    first, second, other = (CALIBRATE.calibrate(model, texts, num_svd_samples=20, seed=s) for s in (3, 3, 4))
    assert time.process_time() - started < 10
    assert first.numpy().tobytes() == second.numpy().tobytes()
    assert not torch.equal(first, other)



def test_calibration_shows_its_progress(tiny, capsys):
    """Issue 40, item 10: the script printed nothing for minutes; a bar counts its texts, with the time left."""
    model, texts = tiny
    CALIBRATE.calibrate(model, texts, num_svd_samples=20, seed=0)
    err = capsys.readouterr().err
    assert "texts (one forward pass each)" in err and f"{len(texts)}/{len(texts)} [" in err, err[-300:]

def test_a_file_of_another_model_is_refused_in_one_line(tiny, tmp_path, tiny_model_dir):
    """Another shape (the shipped SmolLM2 file on the tiny model; the tiny model's file on a 3-layer model), or the
    same shape with another content digest: one line naming the file, before any weight is used."""
    model, texts = tiny
    path = filters_file(tmp_path, model, texts)
    refusals = []
    for setting, config in ((None, model.config), (path, tiny_model(layers=3).config)):
        with pytest.raises(ValueError) as refused:
            make_method("qfilter", budget=80, qfilter_path=setting).check_model(model_shape(config))
        refusals.append(str(refused.value))
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    made = {"kind": "qfilter", "model": {**model_record(tiny_model_dir, config), "digest": "0123456789abcdef"}}
    shape = dataclasses.replace(model_shape(config), name=tiny_model_dir)
    filters = torch.zeros(shape.num_layers, shape.num_kv_heads, shape.head_dim)
    other = save_artifact(tmp_path / "other.safetensors", {"filters": filters}, made)
    with pytest.raises(ValueError) as refused:
        make_method("qfilter", budget=80, qfilter_path=str(other)).check_model(shape)
    refusals.append(str(refused.value))
    assert all("\n" not in r for r in refusals)
    assert "no packaged qfilter calibration" in refusals[0]
    assert "num_layers 2" in refusals[1] and "num_layers 3" in refusals[1]
    assert "0123456789abcdef" in refusals[2]


def test_the_shipped_file_is_smollm2s(smollm2_path):
    """The packaged file is found for the default model by content, holds [L, Hkv, D] filters and says how it was
    made."""
    from pyramidkv.methods.calibrated import model_artifact

    shape = dataclasses.replace(model_shape(LlamaConfig.from_pretrained(smollm2_path)), name=smollm2_path)
    method = make_method("qfilter", budget=64)
    method.check_model(shape)
    tensors, record = model_artifact("qfilter", None, shape)
    assert tuple(tensors["filters"].shape) == (shape.num_layers, shape.num_kv_heads, shape.head_dim)
    assert record["seed"] == 0 and record["settings"]["num_svd_samples"] == 3000 and record["cpu_seconds"] > 0
    assert list(method.files_read(shape)) == ["qfilter_path=packaged smollm2-135m_qfilter.safetensors"]


@pytest.mark.parametrize("argv, message", [
    (["--num_svd_samples", "0"], "--num_svd_samples must be >= 1, got 0"),
    (["--num_texts", "400", "--haystack_dir", str(ROOT / "docs")], "fewer than --num_texts 400 x --length 2048"),
])
def test_the_script_refuses_bad_input_in_one_line(argv, message, capsys, smollm2_path):
    """Before the weights load: `calibrate_qfilter.py: error: ...`, exit status 2."""
    with pytest.raises(SystemExit) as exited:
        CALIBRATE.main(["--model_path", smollm2_path, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and "calibrate_qfilter.py: error: " in err[-1] and message in err[-1]
