"""KVzap: the calibration targets against a float64 reference written from the paper's definition (also with input
norms of non-unit weights, where each query row's own norm matters), the calibration's determinism and fit, the
shipped SmolLM2 predictor against targets on text it never saw (and against a random predictor), the score against
a plain matmul of the predictor, and the refusal of a predictor made on another model. The registry matrix and the
batch-independence matrix run kvzap with an artifact written for their random models (tests/helpers.py
kvzap_artifact)."""

from __future__ import annotations

import math
from copy import deepcopy as copy_module
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from pyramidkv import make_method
from pyramidkv.core.context import ScoreContext
from pyramidkv.methods.kvzap import KVzap, predict
from pyramidkv.models.patch import model_shape
from tests.helpers import kvzap_artifact, load_script
from tests.prompts import STORY

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "calibrate_kvzap.py"
# Text no calibration saw: the story of tests/prompts.py (its first sentences, ~70 tokens: a forward of seconds).
HELD_OUT = STORY.split("Read the story and answer.\n")[1].split(" One year")[0]
# The shipped linear predictor's mean Spearman correlation over layers on HELD_OUT: 0.854 measured (a random
# predictor of the same shapes: 0.02); the floor leaves 0.05 of margin.
SPEARMAN_FLOOR = 0.80


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Torch on one thread: on these sizes more threads only wait for each other (30x slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def calibrate():
    return load_script("calibrate_kvzap", SCRIPT)


@pytest.fixture(scope="module")
def tiny_eager(tiny_model_dir):
    """(model, tokenizer): conftest's 2-layer random Llama (GQA 4 / 2) with eager attention."""
    from transformers import AutoTokenizer

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def reference_targets(model, ids: list[int], user, copy, entries) -> list[float]:
    """For each (layer, KV head, column j): log max over the assistant-copy rows i and the query heads g of the KV
    head's group of A[g, i, j] / ||h_i|| x ||W_O^(g) v_j||, in float64 with loops, from the model's own attention
    weights and its attention inputs (the layer's input norm applied to the hidden states entering the layer)."""
    double = copy_module(model).double().eval()
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    dim = model.config.hidden_size // heads
    out = []
    with torch.no_grad():
        run = double(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
        for layer, kv_head, column in entries:
            block = double.model.layers[layer]
            h = block.input_layernorm(run.hidden_states[layer][0])                    # [n, E]
            attention = run.attentions[layer][0]                                       # [Hq, n, n]
            v = block.self_attn.v_proj(h)[column, kv_head * dim:(kv_head + 1) * dim]   # [D]
            best = 0.0
            for g in range(kv_head * heads // kv_heads, (kv_head + 1) * heads // kv_heads):
                w_o = block.self_attn.o_proj.weight[:, g * dim:(g + 1) * dim]          # [E, D]
                column_norm = float((w_o @ v).norm())
                for i in range(copy[0], copy[1]):
                    best = max(best, float(attention[g, i, column]) / float(h[i].norm()) * column_norm)
            out.append(math.log(best))
    return out


def test_targets_match_a_float64_reference(tiny_eager, calibrate):
    model, tokenizer = tiny_eager
    text = "The lighthouse keeper counted ships. Each ship had a flag, and each flag a colour."
    ids, user, copy = calibrate.repeat_layout(tokenizer, "  " + text + "\n")
    assert tokenizer.decode(ids[user[0]:user[1]]) == text and tokenizer.decode(ids[copy[0]:copy[1]]) == text
    x, y = calibrate.targets(model, ids, user, copy)
    assert x.shape == (2, user[1] - user[0], 64) and y.shape == (2, user[1] - user[0], 2)
    entries = [(0, 0, 0), (0, 1, 5), (1, 0, 9), (1, 1, user[1] - user[0] - 1)]
    expected = reference_targets(model, ids, user, copy, [(l, k, user[0] + j) for l, k, j in entries])
    assert [float(y[l, j, k]) for l, k, j in entries] == pytest.approx(expected, abs=2e-4)
    with torch.no_grad():   # X: the attention input of the user-copy tokens
        out = model(torch.tensor([ids]), output_hidden_states=True)
        h = model.model.layers[1].input_layernorm(out.hidden_states[1][0])
    torch.testing.assert_close(x[1], h[user[0]:user[1]], rtol=1e-5, atol=1e-5)


def test_targets_divide_by_the_assistant_rows_norms(tiny_eager, calibrate):
    """The model's input norms given non-unit weights (seeded, 0.25..4 per channel), so that the attention inputs'
    norms ||h_i|| differ from token to token (with weights all 1 every RMSNorm output has norm ~sqrt(E)), and in
    layer 1 a token of the assistant copy from the same token of the user copy: every target of both layers still
    matches the float64 reference, which divides row i of the assistant copy by that row's own norm."""
    model, tokenizer = tiny_eager
    model = copy_module(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for block in model.model.layers:
            block.input_layernorm.weight.copy_(4.0 ** (2 * torch.rand(64, generator=generator) - 1))
    text = "The lighthouse keeper counted ships. Each ship had a flag, and each flag a colour."
    ids, user, copy = calibrate.repeat_layout(tokenizer, text)
    with torch.no_grad():   # not vacuous: in layer 1 the user rows' norms are not the assistant copy's
        out = model(torch.tensor([ids]), output_hidden_states=True)
        norms = model.model.layers[1].input_layernorm(out.hidden_states[1][0]).norm(dim=-1)
    assert user[1] - user[0] == copy[1] - copy[0]
    assert (norms[user[0]:user[1]].log() - norms[copy[0]:copy[1]].log()).abs().max() > 0.01   # 50 x the tolerance
    _, y = calibrate.targets(model, ids, user, copy)
    entries = [(layer, kv_head, j) for layer in range(2) for kv_head in range(2) for j in range(user[1] - user[0])]
    expected = reference_targets(model, ids, user, copy, [(l, k, user[0] + j) for l, k, j in entries])
    assert [float(y[l, j, k]) for l, k, j in entries] == pytest.approx(expected, abs=2e-4)


def test_calibration_shows_its_progress(tiny_eager, calibrate, capsys):
    """Issue 40, item 10: the script printed nothing for minutes; a bar counts the passages (training and held out),
    with the time left."""
    model, tokenizer = tiny_eager
    passages = [{"text": f"bees hives notebook {word} river lambs swarm oak smoke"} for word in ("a", "b", "c")]
    calibrate.calibrate(model, tokenizer, passages[:2], passages[2:], "linear", 8, seed=1)
    err = capsys.readouterr().err
    assert "passages (targets" in err and "3/3 [" in err, err[-300:]

def test_calibration_is_seeded_deterministic_and_fits_ridge(tiny_eager, calibrate):
    model, tokenizer = tiny_eager
    words = "bees hives notebook library river lambs swarm oak smoke song village mill spring rain".split()
    passages = [{"text": " ".join(words[i:] + words[:i])} for i in range(4)]
    first = calibrate.calibrate(model, tokenizer, passages[:3], passages[3:], "linear", 8, seed=1)
    again = calibrate.calibrate(model, tokenizer, passages[:3], passages[3:], "linear", 8, seed=1)
    other = calibrate.calibrate(model, tokenizer, passages[:3], passages[3:], "linear", 8, seed=2)
    for name in ("weight", "bias"):
        assert torch.equal(first[0][name], again[0][name])
    assert not torch.equal(first[0]["weight"], other[0]["weight"])   # the seed picks the sampled tokens
    assert first[1] == again[1] and set(first[1]["held_out"]) >= {"r2", "mse", "spearman"}
    mlp = [calibrate.calibrate(model, tokenizer, passages[:3], [], "mlp", 8, seed=1, epochs=2) for _ in range(2)]
    assert all(torch.equal(mlp[0][0][k], mlp[1][0][k]) for k in ("w1", "b1", "w2", "b2"))
    assert mlp[0][0]["w1"].shape == (2, 512, 64) and mlp[0][0]["w2"].shape == (2, 2, 512)
    # the ridge solution: X^T (X w + b - y) + alpha w = 0 and the residuals sum to 0, in float64 on the raw data
    x, y = calibrate.targets(model, *calibrate.repeat_layout(tokenizer, passages[0]["text"]))
    sums = calibrate.RidgeSums()
    sums.add(x, y)
    fit = sums.solve(alpha=1.0)
    for layer in range(2):
        w, b = fit["weight"][layer].double(), fit["bias"][layer].double()
        residual = x[layer].double() @ w.T + b - y[layer].double()
        assert residual.sum(dim=0).abs().max() < 1e-3
        assert (x[layer].double().T @ residual + w.T).abs().max() < 1e-3


@pytest.fixture(scope="module")
def smollm2_eager(smollm2_path):
    from pyramidkv import load_model

    return load_model(smollm2_path, attn_implementation="eager", device="cpu")


def test_shipped_predictor_ranks_held_out_targets_and_scores_by_matmul(smollm2_eager, smollm2_path, calibrate):
    model, tokenizer = smollm2_eager
    method = make_method("kvzap", head_allocation="uniform", budget=200)
    shape = model_shape(model.config, 4)
    method.check_model(shape)
    tensors = method.predictor(shape)
    assert sum(t.numel() for t in tensors.values()) == 30 * (576 + 1) * 3   # ~52K parameters
    ids, user, copy = calibrate.repeat_layout(tokenizer, HELD_OUT)
    x, y = calibrate.targets(model, ids, user, copy)                          # [L, u, E], [L, u, Hkv]
    generator = torch.Generator().manual_seed(0)
    random = {"weight": torch.randn(tensors["weight"].shape, generator=generator) * tensors["weight"].std(),
              "bias": tensors["bias"].clone()}
    rho, rho_random = [], []
    for layer in range(30):
        naive = x[layer].double() @ tensors["weight"][layer].double().T + tensors["bias"][layer].double()
        real = torch.ones(1, x.shape[1], dtype=torch.bool)
        ctx = ScoreContext(layer, 30, None, None, None, real, hidden=x[layer][None], model=shape)
        scores = method.score(ctx)[0].T                                       # [u, Hkv]
        torch.testing.assert_close(scores.double(), naive, rtol=0, atol=1e-4)
        rho.append(calibrate.spearman(scores, y[layer]))
        rho_random.append(calibrate.spearman(predict(random, layer, x[layer]), y[layer]))
    assert sum(rho) / 30 >= SPEARMAN_FLOOR, rho
    assert sum(rho) / 30 > sum(rho_random) / 30 + 0.5, (rho, rho_random)


def test_predictor_of_another_model_is_refused_in_one_line(tiny_model_dir, sharp_model_dir, tmp_path):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    path = kvzap_artifact(model, tmp_path / "tiny_kvzap-linear.safetensors")
    method = make_method("kvzap", head_allocation="uniform", budget=200, kvzap_path=path)
    method.check_model(model_shape(model.config, 4))                      # made on it: accepted
    shorter = copy_module(model.config)
    shorter.num_hidden_layers, shorter._name_or_path = 3, ""
    for config, said in [(LlamaForCausalLM.from_pretrained(sharp_model_dir).config, "another checkpoint"),
                         (shorter, "num_layers 3")]:
        with pytest.raises(ValueError, match=said) as refusal:
            make_method("kvzap", head_allocation="uniform", budget=200, kvzap_path=path).check_model(
                model_shape(config, 4))
        assert "\n" not in str(refusal.value)
    with pytest.raises(ValueError, match="no packaged kvzap-mlp calibration") as refusal:
        make_method("kvzap", head_allocation="uniform", budget=200, kvzap_model="mlp").check_model(
            model_shape(model.config, 4))
    assert "\n" not in str(refusal.value)


@pytest.mark.parametrize("argv, said", [
    (["--model_type", "linear", "--out", "x.safetensors", "--texts", "0"], "--texts"),
    (["--model_type", "cubic", "--out", "x.safetensors"], "--model_type"),
    (["--model_type", "mlp", "--out", "x.json"], "--out")])
def test_calibration_script_refuses_bad_flags_in_one_line(calibrate, capsys, argv, said):
    with pytest.raises(SystemExit) as stop:
        calibrate.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and said in err[-1] and err[-1].startswith("calibrate_kvzap.py: error:")


def test_threshold_eviction_computes_each_prompt_of_a_batch_alone(random_llama):
    """kvzap's default rule (threshold, decided while decoding too) on a left-padded batch of 3: each prompt gets
    the tokens, kept sets and bytes it gets alone. The threshold is the median predicted score of the first
    prompt's tokens at layer 0, so tokens are both kept and evicted."""
    from tests.engine_snapshot import assert_batch_equals_alone

    model, tokenizer, tables = random_llama
    text = "A keeper logged every ship in a ledger with a green cover, and the hour and the flag of each. "
    prompts = [tokenizer(text * k + "Which cover?", add_special_tokens=False).input_ids for k in (6, 3, 1)]
    probe = make_method("kvzap", kvzap_path=tables["kvzap_path"], window_size=16, head_allocation="uniform", budget=32)
    shape = model_shape(model.config, 4)
    probe.check_model(shape)
    with torch.no_grad():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(torch.tensor([prompts[0]])))
    threshold = float(predict(probe.predictor(shape), 0, hidden[0]).median())
    method = make_method("kvzap", kvzap_path=tables["kvzap_path"], window_size=16, threshold=threshold)
    alones = assert_batch_equals_alone(model, tokenizer, method, prompts, 24)
    counts = [c for layer in alones[0]["prefill"]["layers"] for c in layer[0]["counts"]]
    assert min(counts) < len(prompts[0]) - 16 and max(counts) > 16, counts   # some tokens evicted, some kept


def test_calibration_script_writes_an_mlp_the_method_reads(tiny_model_dir, tmp_path, calibrate):
    from transformers import AutoConfig

    from pyramidkv.methods.calibrated import load_artifact

    out = tmp_path / "tiny_kvzap-mlp.safetensors"
    calibrate.main(["--model_path", tiny_model_dir, "--model_type", "mlp", "--out", str(out), "--texts", "2",
                    "--held_out", "1", "--min_tokens", "20", "--max_tokens", "30", "--epochs", "1"])
    _, record = load_artifact(out, "kvzap-mlp")
    assert record["model"]["num_layers"] == 2 and record["seed"] == 0 and record["cpu_seconds"] > 0
    assert all(len(f["sha256"]) == 64 for f in record["data"]["files"]) and len(record["data"]["train"]) == 2
    assert {p["source"] for p in record["data"]["train"]}.isdisjoint(p["source"] for p in record["data"]["held_out"])
    method = make_method("kvzap", kvzap_model="mlp", kvzap_path=str(out), head_allocation="uniform", budget=200)
    shape = model_shape(AutoConfig.from_pretrained(tiny_model_dir), 4)
    method.check_model(shape)
    t = {name: value.double() for name, value in method.predictor(shape).items()}
    assert t["w1"].shape == (2, 512, 64)
    hidden = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))          # [B, n, E]
    real = torch.tensor([[False, False, True, True, True], [True] * 5])                # row 0 left-padded
    scores = method.score(ScoreContext(1, 2, None, None, None, real, hidden=hidden, model=shape))   # [B, Hkv, n]
    inner = hidden.double() @ t["w1"][1].T + t["b1"][1]
    naive = (0.5 * inner * (1 + torch.erf(inner / math.sqrt(2)))) @ t["w2"][1].T + t["b2"][1]   # exact GELU
    torch.testing.assert_close(scores.transpose(1, 2).double()[real], naive[real], rtol=0, atol=1e-4)
    assert (scores[0, :, :2] == 0).all()                                               # padding scores 0
