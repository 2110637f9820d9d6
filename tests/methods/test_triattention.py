"""TriAttention: the calibration against float64 query statistics computed here from the unpatched model; the held
sets at every decode step against a float64 simulation of the authors' rule (per layer and KV head, z-normalised
trigonometric scores from the pre-RoPE keys, the query group's maximum, back to the budget at budget + interval);
a batch of three left-padded prompts equals each alone; bytes below fullkv's; the shipped file; refusals, one
line each, a file of another model before any weight is used."""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pyramidkv import make_method
from pyramidkv.generation import generate
from pyramidkv.methods.calibrated import model_record, save_artifact
from pyramidkv.models.patch import model_shape
from tests.conftest import tiny_llama
from tests.engine_snapshot import assert_batch_equals_alone
from tests.helpers import ROOT, TokenIds, load_script

CALIBRATE = load_script("calibrate_triattention", ROOT / "scripts" / "calibrate_triattention.py")
PROMPT, BUDGET, INTERVAL, STEPS = 40, 32, 8, 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, prompt, centres file): a 2-layer random Llama (GQA 4 / 2, head_dim 16), torch on one thread, its
    centres calibrated by the script on two random texts of 24 tokens."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_llama(layers=2, vocab=96, std=0.2)
    texts = torch.randint(3, 96, (2, 24), generator=torch.Generator().manual_seed(1)).tolist()
    made = {"kind": "triattention", "model": model_record(str(tmp_path_factory.mktemp("none") / "x"), model.config)}
    path = save_artifact(tmp_path_factory.mktemp("tri") / "centres.safetensors", CALIBRATE.calibrate(model, texts),
                         made)
    prompt = torch.randint(3, 96, (PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    yield model, texts, prompt, str(path)
    torch.set_num_threads(threads)


def test_calibration_equals_float64_statistics_of_the_pre_rope_queries(tiny):
    """q_proj of the layer's normed input (no RoPE at all), in float64: the complex mean and mean magnitude of the
    (q[f], q[f + D/2]) pairs over every position of both texts."""
    model, texts, _, path = tiny
    got = load_file(path)
    m = copy.deepcopy(model).double()
    queries = []
    with torch.no_grad():
        for tokens in texts:
            hidden = m(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            queries.append([layer.self_attn.q_proj(layer.input_layernorm(h))[0].view(len(tokens), 4, 16).numpy()
                            for layer, h in zip(m.model.layers, hidden)])
    for layer in range(2):
        q = np.concatenate([per_text[layer] for per_text in queries])            # [n, Hq, D]
        pairs = q[..., :8] + 1j * q[..., 8:]
        np.testing.assert_allclose(got["q_mean_real"][layer].numpy(), pairs.mean(0).real, atol=2e-5)
        np.testing.assert_allclose(got["q_mean_imag"][layer].numpy(), pairs.mean(0).imag, atol=2e-5)
        np.testing.assert_allclose(got["q_abs_mean"][layer].numpy(), np.abs(pairs).mean(0), atol=2e-5)


def authors_scores(pre_keys: np.ndarray, positions: list[int], now: int, centre: np.ndarray, magnitude: np.ndarray,
                   omega: np.ndarray, window: int) -> np.ndarray:
    """The authors' score of each key (pre-RoPE keys [m, D] at `positions`) for one query head, in float64: the mean
    over the offsets 1, 2, 4, ... <= window of sum_f |c_f||k_f| cos(w_f (now + o - p) + arg(c_f conj k_f)), plus
    sum_f (a_f - |c_f|) |k_f|; then z-normalised over the m keys (biased std)."""
    half = pre_keys.shape[1] // 2
    k = pre_keys[:, :half] + 1j * pre_keys[:, half:]                             # [m, F]
    phase = np.angle(centre[None] * np.conj(k))
    amplitude = np.abs(centre)[None] * np.abs(k)
    offsets = [2 ** i for i in range(20) if 2 ** i <= window]
    trig = np.mean([(amplitude * np.cos(omega[None] * (now + o - np.array(positions))[:, None] + phase)).sum(1)
                    for o in offsets], axis=0)
    score = trig + ((magnitude - np.abs(centre))[None] * np.abs(k)).sum(1)
    return (score - score.mean()) / max(score.std(), 1e-6)


def keep_top(positions: list[int], score: np.ndarray, keep: int) -> set[int]:
    """The `keep` best (ties: the more recent)."""
    order = sorted(range(len(positions)), key=lambda i: (-score[i], -positions[i]))
    return {positions[i] for i in order[:keep]}


def simulate(model, tokens: list[int], prompt_len: int, path: str, window: int) -> list[list[list[set[int]]]]:
    """The authors' rule on a float64 model, one forward per step (the prompt, then one token each): per step, per
    layer, per KV head the positions held. Each query head attends its KV head's held tokens and the new ones;
    then a head holding more than BUDGET after the prompt, or BUDGET + INTERVAL after a step, keeps the BUDGET best
    by the maximum over its query group of authors_scores."""
    m = model.model
    heads, kv_heads, dim = 4, 2, 16
    group = heads // kv_heads
    centres = load_file(path)
    centre = centres["q_mean_real"].double().numpy() + 1j * centres["q_mean_imag"].double().numpy()
    magnitude = centres["q_abs_mean"].double().numpy()
    omega = 1.0 / (model.config.rope_theta ** (np.arange(0, dim, 2) / dim))
    pre, post, values = ([[] for _ in m.layers] for _ in range(3))
    held = [[[] for _ in range(kv_heads)] for _ in m.layers]
    history, start = [], 0
    with torch.no_grad():
        for chunk in [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]:
            q_len = len(chunk)
            positions = torch.arange(start, start + q_len)[None]
            h = m.embed_tokens(torch.tensor([chunk]))
            cos, sin = m.rotary_emb(h, positions)
            for layer, block in enumerate(m.layers):
                attn = block.self_attn
                x = block.input_layernorm(h)
                q = attn.q_proj(x).view(1, q_len, heads, dim).transpose(1, 2)
                k = attn.k_proj(x).view(1, q_len, kv_heads, dim).transpose(1, 2)
                v = attn.v_proj(x).view(1, q_len, kv_heads, dim).transpose(1, 2)
                pre[layer].append(k[0].numpy())
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                post[layer].append(k)
                values[layer].append(v)
                keys, vals = torch.cat(post[layer], dim=2), torch.cat(values[layer], dim=2)
                new = list(range(start, start + q_len))
                outs = []
                for head in range(heads):
                    visible = torch.zeros(q_len, start + q_len, dtype=torch.bool)
                    visible[:, held[layer][head // group] + new] = True
                    visible &= torch.arange(start + q_len)[None, :] <= positions[0][:, None]
                    logits = q[0, head] @ keys[0, head // group].T / dim ** 0.5
                    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
                    outs.append(probs @ vals[0, head // group])
                h = h + attn.o_proj(torch.stack(outs, dim=1).reshape(1, q_len, -1))
                h = h + block.mlp(block.post_attention_layernorm(h))
                every = np.concatenate(pre[layer], axis=1)                          # [Hkv, t, D]
                fire = start == 0 or any(len(held[layer][kv]) + q_len >= BUDGET + INTERVAL for kv in range(kv_heads))
                for kv in range(kv_heads):
                    candidates = held[layer][kv] + new
                    if fire and len(candidates) > BUDGET:
                        score = np.max([authors_scores(every[kv, candidates], candidates, start + q_len,
                                                       centre[layer, head], magnitude[layer, head], omega, window)
                                        for head in range(kv * group, (kv + 1) * group)], axis=0)
                        candidates = sorted(keep_top(candidates, score, BUDGET))
                    held[layer][kv] = candidates
            history.append([[set(p) for p in layer] for layer in held])
            start += q_len
    return history


@pytest.mark.parametrize("window", [65536, 256])
def test_held_sets_follow_the_authors_rule_at_every_step(tiny, window):
    """The prompt (40 > 32) cut at prefill, then back to 32 each time a head holds 40: five re-selections in 40
    steps, every layer and KV head against the simulation, the authors' offsets up to 65,536 and a short window."""
    model, _, prompt, path = tiny
    method = make_method("triattention", budget=BUDGET, decode_interval=INTERVAL, triattention_path=path,
                         frequency_window=window)
    held, fed = [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        held.append([[set(p.tolist()) for p in cache.held_positions(layer, 0)] for layer in range(2)])
        fed.extend(kwargs["input_ids"][0].tolist())

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        generate(model, TokenIds(), [prompt], method, STEPS + 1, stop_token_ids=[])
    finally:
        hook.remove()
    assert fed[:PROMPT] == prompt and len(held) == STEPS + 1
    expected = simulate(copy.deepcopy(model).double(), fed, PROMPT, path, window)
    for step, (got, want) in enumerate(zip(held, expected)):
        assert got == want, f"step {step}: {[[sorted(a ^ b) for a, b in zip(g, w)] for g, w in zip(got, want)]}"
    sizes = [len(s) for layer in held for s in layer[0]]
    assert max(sizes) == BUDGET + INTERVAL - 1 and min(sizes) == BUDGET
    assert any(held[s][0][0] != held[s][0][1] for s in range(len(held))), "the KV heads choose apart"


def test_a_batch_of_three_equals_each_alone_and_holds_fewer_bytes_than_fullkv(random_llama, request):
    model, tokenizer, tables = random_llama
    prompts = [torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (50, 37, 21)]
    method = make_method("triattention", budget=24, decode_interval=8, triattention_path=tables["triattention_path"])
    alone = assert_batch_equals_alone(model, tokenizer, method, prompts, 24, request)
    full = generate(model, tokenizer, prompts[:1], make_method("fullkv"), 24, stop_token_ids=[])[0]
    compressed = generate(model, tokenizer, prompts[:1], method, 24, stop_token_ids=[])[0]
    assert compressed.kv_bytes_per_prompt < full.kv_bytes_per_prompt / 2
    assert alone[0]["kv_bytes_after"][0] == compressed.kv_bytes_per_prompt


def test_the_shipped_file_is_smollm2s(smollm2_path):
    from pyramidkv.methods.calibrated import model_artifact

    shape = dataclasses.replace(model_shape(LlamaConfig.from_pretrained(smollm2_path)), name=smollm2_path)
    method = make_method("triattention", budget=64)
    method.check_model(shape)
    tensors, record = model_artifact("triattention", None, shape)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {name: (30, 9, 32) for name in
                                                                     ("q_mean_real", "q_mean_imag", "q_abs_mean")}
    assert record["data"] == {**record["data"], "num_texts": 2, "length": 1024} and record["cpu_seconds"] > 0
    assert bool((tensors["q_abs_mean"] >= torch.complex(tensors["q_mean_real"], tensors["q_mean_imag"]).abs()).all())
    assert list(method.files_read(shape)) == ["triattention_path=packaged smollm2-135m_triattention.safetensors"]


def test_a_file_of_another_model_is_refused_in_one_line(tiny, tiny_model_dir, tmp_path):
    """The shipped SmolLM2 file on the tiny model, the tiny model's file on a 3-layer one, a file of the same shape
    and another content: one line each, from check_model (what the runners call before the weights load)."""
    model, _, _, path = tiny
    refusals = []
    for setting, config in ((None, model.config), (path, tiny_llama(layers=3, vocab=96, std=0.2).config)):
        with pytest.raises(ValueError) as refused:
            make_method("triattention", budget=32, triattention_path=setting).check_model(model_shape(config))
        refusals.append(str(refused.value))
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    made = {"kind": "triattention", "model": {**model_record(tiny_model_dir, config), "digest": "0123456789abcdef"}}
    shape = dataclasses.replace(model_shape(config), name=tiny_model_dir)
    size = (shape.num_layers, shape.num_query_heads, shape.head_dim // 2)
    other = save_artifact(tmp_path / "other.safetensors", {name: torch.zeros(size) for name in
                                                           ("q_mean_real", "q_mean_imag", "q_abs_mean")}, made)
    with pytest.raises(ValueError) as refused:
        make_method("triattention", budget=32, triattention_path=str(other)).check_model(shape)
    refusals.append(str(refused.value))
    assert all("\n" not in r for r in refusals)
    assert "no packaged triattention calibration" in refusals[0]
    assert "num_layers 2" in refusals[1] and "num_layers 3" in refusals[1]
    assert "0123456789abcdef" in refusals[2]


@pytest.mark.parametrize("settings, fragment", [
    (dict(budget=32, decode_budget=None), "decode_budget=None would never evict"),
    (dict(budget_ratio=0.5), "needs decode_budget"),
    (dict(budget=32, frequency_window=0), "frequency_window must be an integer >= 1"),
    (dict(budget=32, offset_aggregation="median"), "offset_aggregation must be one of mean|max"),
    (dict(budget=32, decode_interval=0), "decode_interval must be an integer >= 1"),
    (dict(threshold=0.5), "does not combine with threshold eviction"),
])
def test_bad_settings_are_refused_in_one_line(settings, fragment):
    with pytest.raises(ValueError) as refusal:
        make_method("triattention", **settings)
    assert fragment in str(refusal.value) and "\n" not in str(refusal.value)


@pytest.mark.parametrize("argv, message", [
    (["--num_texts", "0"], "--num_texts must be >= 1, got 0"),
    (["--num_texts", "400", "--haystack_dir", str(ROOT / "docs")], "fewer than --num_texts 400 x --length 1024"),
])
def test_the_script_refuses_bad_input_in_one_line(argv, message, capsys, smollm2_path):
    with pytest.raises(SystemExit) as exited:
        CALIBRATE.main(["--model_path", smollm2_path, *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert exited.value.code == 2 and "calibrate_triattention.py: error: " in err[-1] and message in err[-1]
