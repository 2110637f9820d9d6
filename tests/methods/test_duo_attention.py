"""DuoAttention: the official pattern format, the two head selections, the removed share, calibration
(scripts/calibrate_duo.py), the refusals, and on a tiny random Llama the stored heads and the decode output."""

from __future__ import annotations

import copy
import json
import re
import sys

import numpy as np
import pytest
import torch

from pyramidkv.allocation.base import ModelShape
from pyramidkv.methods.duo_attention import (NOISE_SEED, model_pattern, read_pattern, removed_share,
                                             streaming_heads)
from tests.conftest import tiny_llama
from tests.helpers import ROOT, TokenIds, load_script

CALIBRATE = load_script("calibrate_duo", ROOT / "scripts/calibrate_duo.py")


def write_tsv(path, rows) -> None:
    path.write_text("".join("\t".join(str(x) for x in row) + "\n" for row in rows))


def test_reads_the_official_format_clipped(tmp_path):
    """An official folder (no pyramidkv record): L rows of tab-separated floats, read with clip(0, 1)."""
    folder = tmp_path / "lr=0.02-reg=0.05-ctx=1000_32000-multi_passkey10"
    folder.mkdir()
    write_tsv(folder / "full_attention_heads.tsv", [[-0.0213, 1.0], [0.4998, 1.27], [1e-05, -3e-06]])
    (folder / "config.json").write_text(json.dumps({"sink_size": 128, "recent_size": 256, "lr": 0.02}))
    expected = np.array([[0.0, 1.0], [0.4998, 1.0], [1e-05, 0.0]])
    for path in (folder, folder / "full_attention_heads.tsv"):
        gates, record, tsv = read_pattern(path)
        np.testing.assert_array_equal(gates, expected)
        assert record is None and tsv == folder / "full_attention_heads.tsv"
    gates, _ = model_pattern(str(folder), ModelShape(3, 4, 2, name="any"))   # shape check only
    np.testing.assert_array_equal(gates, expected)


@pytest.mark.parametrize("case", ["missing", "shape", "text"])
def test_pattern_refusals_are_one_line(tmp_path, case):
    tsv = tmp_path / "full_attention_heads.tsv"
    if case == "text":
        tsv.write_text("0.1\tx\n")
    elif case == "shape":
        write_tsv(tsv, [[0.1, 0.2, 0.3]] * 3)
    says = {"missing": "no such file", "shape": "3 rows x 3 gates; this model has 3 layers x 2 KV heads",
            "text": "tab-separated numbers"}[case]
    with pytest.raises(ValueError, match=says) as e:
        model_pattern(str(tsv if case != "missing" else tmp_path / "nope"), ModelShape(3, 4, 2))
    assert "\n" not in str(e.value)


# 2 layers x 3 KV heads, three ties at 0 and two at 1 (flat indices 0..5).
TIES = np.array([[0.0, 1.0, 0.0], [0.3, 0.0, 1.0]])


@pytest.mark.parametrize("share, streams", [(1 / 3, 2), (0.5, 3), (0.6, 3), (0.75, 4), (0.0, 0), (1.0, 6)])
def test_quantile_and_argsort_selections(share, streams):
    """argsort (kvpress): round(6 x share) lowest stream, ties in index order; quantile (official): noise
    U(0, 1e-6) seeded, heads below np.quantile(noisy, share) stream, ties broken by the noise."""
    argsort = streaming_heads(TIES, share, "argsort").reshape(-1)
    order = [0, 2, 4, 3, 1, 5]                      # values 0, 0, 0, 0.3, 1, 1 with ties by index
    assert set(np.flatnonzero(argsort)) == set(order[:round(6 * share)])
    noise = np.random.default_rng(NOISE_SEED).uniform(0, 1e-6, 6)
    by_noise = sorted(range(6), key=lambda i: (TIES.reshape(-1)[i], noise[i]))
    quantile = streaming_heads(TIES, share, "quantile").reshape(-1)
    # np.quantile at share over 6 values: position 5 x share; heads strictly below stream
    assert set(np.flatnonzero(quantile)) == set(by_noise[:streams])
    assert (streaming_heads(TIES, share, "quantile") == quantile.reshape(2, 3)).all()   # seeded: the same again


def test_quantile_ties_follow_the_noise_not_the_index():
    """Among the three zeros at share 1/3 (two stream) the noise picks, so the rule can differ from argsort."""
    noise = np.random.default_rng(NOISE_SEED).uniform(0, 1e-6, 6)
    zeros = sorted([0, 2, 4], key=lambda i: noise[i])
    assert set(np.flatnonzero(streaming_heads(TIES, 1 / 3, "quantile"))) == set(zeros[:2])


@pytest.mark.parametrize("n", [200, 320, 1000, 4096])
def test_removed_share_against_a_hand_count(n):
    streaming = streaming_heads(TIES, 0.5, "argsort")
    sinks, recent = 64, 256
    kept = sum(min(n, sinks + recent) if s else n for s in streaming.reshape(-1))
    assert removed_share(streaming.mean(), sinks, recent, n) == pytest.approx(1 - kept / (streaming.size * n))
    if n == 4096:   # kvpress #228's figure: 0.875 of the heads streaming at 4,096 tokens with 128 + 256
        assert removed_share(0.875, 128, 256, 4096) == pytest.approx(0.793, abs=1e-3)


# --- calibration ----------------------------------------------------------------------------------------------

TINY_GATE = ["--num_steps", "5", "--context_length_min", "192", "--context_length_max", "224", "--num_passkeys", "2",
             "--passkey_words", "3", "--sink_size", "4", "--recent_size", "16", "--lr", "0.05"]
TINY_FLY = ["--on_the_fly", "--num_samples", "2", "--sample_tokens", "64", "--positions", "50"]


@pytest.mark.parametrize("recipe", ["gate", "on_the_fly"])
def test_calibration_is_deterministic_and_records_its_making(recipe, tiny_model_dir, sharp_model_dir, tmp_path,
                                                             monkeypatch):
    monkeypatch.setattr(sys, "argv", ["calibrate_duo.py"])
    argv = TINY_GATE if recipe == "gate" else TINY_FLY
    outs = [CALIBRATE.main(["--model_path", tiny_model_dir, "--out", str(tmp_path / str(i)), *argv])
            for i in range(2)]
    texts = [(out / "full_attention_heads.tsv").read_text() for out in outs]
    assert texts[0] == texts[1]
    gates, record, _ = read_pattern(outs[0])
    assert gates.shape == (2, 2) and len(texts[0].splitlines()) == 2
    config = json.loads((outs[0] / "config.json").read_text())
    assert config["sink_size"] == (4 if recipe == "gate" else 8) and "recent_size" in config
    assert record["kind"] == "duo" and record["model"]["num_kv_heads"] == 2 and record["cpu_seconds"] >= 0
    assert record["data"]["files"] and all(len(f["sha256"]) == 16 for f in record["data"]["files"])
    raw = np.loadtxt(outs[0] / "full_attention_heads.tsv", ndmin=2)
    if recipe == "gate":   # the gates moved from 1.0 (the L1 term alone pulls every gate down)
        assert (raw < 1.0).all() and config["num_steps"] == 5 and record["settings"]["rows"] == "official"
    else:                  # cumulative attention, mean over 50 positions: within (0, 1]
        assert ((raw > 0) & (raw <= 1)).all()
    model_pattern(str(outs[0]), ModelShape(2, 4, 2, name=tiny_model_dir))
    with pytest.raises(ValueError, match="another checkpoint or a fine-tune") as e:   # same shape, other weights
        model_pattern(str(outs[0]), ModelShape(2, 4, 2, name=sharp_model_dir))
    assert "\n" not in str(e.value)


def test_lr_factor_is_the_official_schedule():
    """min(1, max((s + 1) / (T // 5), 0.1), max((T - s) / (T // 5), 0.1)): integer division, as the official."""
    steps = 100
    factors = [CALIBRATE.lr_factor(s, steps) for s in range(steps)]
    assert factors[0] == pytest.approx(0.1) and factors[1] == pytest.approx(0.1)   # floored: (s+1)/20 < 0.1
    assert factors[9] == pytest.approx(0.5) and factors[19] == 1.0 and factors[50] == 1.0
    assert factors[90] == pytest.approx(0.5) and factors[99] == pytest.approx(0.1)
    # 12 steps: 12 // 5 = 2 steps of warm-up and of decay (12 / 5 would give 1 / 2.4 at step 0)
    assert [CALIBRATE.lr_factor(s, 12) for s in (0, 1, 10, 11)] == [0.5, 1.0, 1.0, 0.5]


class Chars:
    """A tokenizer of one token per character (its code point); special tokens: a leading 1."""

    def __call__(self, text, add_special_tokens=True):
        return type("Encoding", (), {"input_ids": [1] * add_special_tokens + [ord(c) for c in text]})()


def test_the_sample_is_the_official_layout_and_its_labels_every_token_after_the_context():
    """duo-attention data.py, written out from its rules: "<|im_start|> This is a very long story book: <book> "
    (special tokens on), the first context_length haystack tokens with "\n\n" + needle + passkey + "\n\n" at
    int(len x depth) for sorted depths, pad to a multiple of 16 (1..16 tokens, from the haystack's end), " </book>.\n\n",
    then per passkey question + passkey + "\n\n"; labels: every token of that last part."""
    text = [ord(c) for c in "abcdefghijklmnopqrstuvwxyz" * 40]
    rng = np.random.default_rng(5)
    ids, qa, answer = CALIBRATE.passkey_sample(np.random.default_rng(5), Chars(), text, 300, 1000, 2, 3)
    keys = [" ".join(rng.choice(CALIBRATE.NATO, 3)) for _ in range(2)]
    depths = sorted(rng.choice(np.linspace(0.05, 0.95, 1000), 2, replace=False))
    hay = "".join(chr(t) for t in text[:300])
    ordinal = ["first", "second"]
    book, last = "<|im_start|> This is a very long story book: <book> ", 0
    for i, depth in enumerate(depths):
        cut = int(300 * depth)
        book += hay[last:cut] + f"\n\nRemeber this sequence of words, it's the {ordinal[i]} passkey to the vault: " \
            f"{keys[i]}\n\n"
        last = cut
    book += hay[last:]
    questions = "".join(f"Based on the content of the book, what is the {ordinal[i]} passkey to the vault?\nPasskey: "
                        f"{keys[i]}\n\n" for i in range(2))
    pad = 16 - (1 + len(book) + len(questions) + len(" </book>.\n\n")) % 16
    got = [chr(t) for t in ids[1:].tolist()]
    assert ids[0] == 1 and (1 + len(book) + pad + len(" </book>.\n\n") + len(questions)) % 16 == 0
    assert "".join(got[:len(book)]) == book and 1 <= pad <= 16
    assert "".join(got[len(book) + pad:]) == " </book>.\n\n" + questions
    assert "".join(got[i - 1] for i in qa.nonzero().squeeze(1).tolist()) == questions
    assert "".join(got[i - 1] for i in answer.nonzero().squeeze(1).tolist()) == keys[0] + keys[1]


def attention_inputs(block, h: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [1, Hq, n, D] of a Llama decoder layer on hidden states h [1, n, d]: RoPE applied, K/V repeated to the
    query heads."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn, n = block.self_attn, h.shape[1]
    heads, kv_heads = attn.num_heads, attn.num_key_value_heads
    x = block.input_layernorm(h)
    q = attn.q_proj(x).view(1, n, heads, -1).transpose(1, 2)
    k = attn.k_proj(x).view(1, n, kv_heads, -1).transpose(1, 2)
    v = attn.v_proj(x).view(1, n, kv_heads, -1).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    return q, k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)


def gated_hidden(model, ids: torch.Tensor, alpha: torch.Tensor | None, sink: int, recent: int) -> torch.Tensor:
    """float64 final hidden states [n, d] from the weights: each head's attention output alpha x full causal +
    (1 - alpha) x streaming (keys j < sink or i - j < recent), alpha [L, Hkv] per KV head (None: full)."""
    m = model.model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group, n = heads // kv_heads, len(ids)
    h = m.embed_tokens(ids[None])
    cos, sin = m.rotary_emb(h, torch.arange(n)[None])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    band = causal & ((j < sink) | (i - j < recent))
    with torch.no_grad():
        for layer, block in enumerate(m.layers):
            attn = block.self_attn
            q, k, v = attention_inputs(block, h, cos, sin)
            logits = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            full = torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1) @ v
            stream = torch.softmax(logits.masked_fill(~band, float("-inf")), dim=-1) @ v
            a = torch.ones(heads, dtype=torch.float64) if alpha is None else \
                alpha[layer].double().repeat_interleave(group)
            out = a[None, :, None, None] * full + (1 - a[None, :, None, None]) * stream
            h = h + attn.o_proj(out.transpose(1, 2).reshape(1, n, -1))
            h = h + block.mlp(block.post_attention_layernorm(h))
        return m.norm(h)[0]


def test_the_gate_loss_reads_the_official_rows_against_a_float64_hand_loss(tiny):
    """The loss at random gates equals the official objective computed by hand in float64: labels -100 over the
    context, the qa tokens labelled, the hidden states at the labelled tokens (unshifted); mean over them of the mean
    squared difference + reg x mean |alpha|. The `answer` rows (the positions before each passkey token) give
    another loss."""
    model, prompt, _ = tiny
    ids = torch.tensor(prompt * 2)                                          # 48 tokens
    qa = torch.arange(48) >= 36                                             # the last 12 tokens: the official labels
    answer = torch.zeros(48, dtype=torch.bool)
    answer[40:44] = True                                                    # a passkey inside them
    alpha = torch.rand(2, 2, generator=torch.Generator().manual_seed(3))
    gates = CALIBRATE.GatedAttention(model, 2, 6)
    try:
        with torch.no_grad():
            gates.alpha.copy_(alpha)
        losses = {rows: CALIBRATE.gate_loss(gates, model.model, ids, CALIBRATE.loss_rows(qa, answer, rows), 0.05)[0]
                  .item() for rows in CALIBRATE.ROWS}
    finally:
        gates.remove()
    double = copy.deepcopy(model).double()
    full, gated = gated_hidden(double, ids, None, 2, 6), gated_hidden(double, ids, alpha, 2, 6)
    labels = torch.tensor([-100] * 36 + ids[36:].tolist())
    rows = labels != -100
    hand = (full[rows] - gated[rows]).pow(2).mean(-1).sum() / rows.sum() + 0.05 * alpha.double().abs().mean()
    assert losses["official"] == pytest.approx(hand.item(), rel=1e-4)
    shifted = torch.arange(39, 43)
    other = (full[shifted] - gated[shifted]).pow(2).mean(-1).mean() + 0.05 * alpha.double().abs().mean()
    assert losses["answer"] == pytest.approx(other.item(), rel=1e-4)
    assert abs(losses["official"] - losses["answer"]) > 1e-3 * hand.item()


@pytest.mark.parametrize("argv, says", [
    (["--num_passkeys", "11"], "--num_passkeys must be in 1..10"),
    (["--context_length_min", "600", "--context_length_max", "500"], "--context_length_max 500"),
    (["--lr", "0"], "--lr must be > 0"),
    (["--num_steps", "4"], "--num_steps must be >= 5 (the official schedule divides by num_steps // 5)"),
    (["--context_length_min", "60", "--context_length_max", "90"], "--context_length_max 90 leaves no haystack"),
    (["--haystack_dir", "{tmp}"], "no .txt files"),
])
def test_calibration_refuses_bad_values_before_loading(argv, says, tiny_model_dir, tmp_path, capsys, monkeypatch):
    import pyramidkv.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("the model loaded before the check"))
    monkeypatch.setattr(sys, "argv", ["calibrate_duo.py"])
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        CALIBRATE.main(["--model_path", tiny_model_dir, "--out", str(tmp_path / "o"),
                        *[a.replace("{tmp}", str(tmp_path)) for a in argv]])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("calibrate_duo.py: error: "), err
    assert says in err


# --- on a tiny random Llama: what each head stores, and the decode output ---------------------------------------

PROMPT, STEPS, SINKS, WINDOW = 24, 6, 2, 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model, prompt, pattern folder): 2 layers x 2 KV heads (4 query heads), weights of std 0.2 (a masked key
    moves the logits), torch on one thread; the pattern streams heads (0, 1) and (1, 0) at share 0.5."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    model = tiny_llama(layers=2, vocab=96, std=0.2)
    prompt = torch.randint(3, 96, (PROMPT,), generator=torch.Generator().manual_seed(1)).tolist()
    folder = tmp_path_factory.mktemp("duo-pattern")
    write_tsv(folder / "full_attention_heads.tsv", [[0.93, 0.08], [-0.01, 1.2]])
    yield model, prompt, folder
    torch.set_num_threads(threads)


def reference(model, tokens: list[int], streaming: set[tuple[int, int]]) -> list[torch.Tensor]:
    """float64 logits of every decode forward (the prompt's last, then one per token) from the weights: the prompt
    attends causally in full; a decode query of a streaming KV head's group attends to the first SINKS positions
    and the last WINDOW held before it plus itself (then the oldest leaves: sinks + the last WINDOW stay)."""
    m = model.model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    ids = torch.tensor([tokens])
    n = len(tokens)
    positions = torch.arange(n)[None]
    h = m.embed_tokens(ids)
    cos, sin = m.rotary_emb(h, positions)
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= p
    band = causal & ((j < SINKS) | (p - j <= WINDOW) | (p < PROMPT))
    with torch.no_grad():
        for layer, block in enumerate(m.layers):
            attn = block.self_attn
            q, k, v = attention_inputs(block, h, cos, sin)
            visible = torch.stack([band if (layer, head // group) in streaming else causal for head in range(heads)])
            logits = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
            probs = torch.softmax(logits.masked_fill(~visible[None], float("-inf")), dim=-1)
            h = h + attn.o_proj((probs @ v).transpose(1, 2).reshape(1, n, -1))
            h = h + block.mlp(block.post_attention_layernorm(h))
        out = model.lm_head(m.norm(h))[0]
    return [out[i] for i in range(PROMPT - 1, n)]


def test_streaming_heads_hold_sinks_and_a_sliding_window(tiny):
    """After the prefill and after every decode step a streaming head holds positions 0..SINKS-1 and the last
    WINDOW, a retrieval head everything; every step's logits equal the float64 reference with those heads' decode
    attention masked to that set (and differ from the unmasked model's)."""
    from pyramidkv.generation import generate
    from pyramidkv.methods import make_method

    model, prompt, folder = tiny
    method = make_method("duo_attention", duo_pattern=str(folder), window_size=WINDOW, num_sinks=SINKS)
    streaming = {(0, 1), (1, 0)}
    held, logits, fed = [], [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        held.append([[set(p.tolist()) for p in cache.held_positions(layer, 0)] for layer in range(2)])
        logits.append(output.logits[0, -1].double())
        fed.extend(kwargs["input_ids"][0].tolist())

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        generate(model, TokenIds(), [prompt], method, STEPS + 1, stop_token_ids=[])
    finally:
        hook.remove()
    assert fed[:PROMPT] == prompt and len(held) == STEPS + 1
    for step, layers in enumerate(held):
        last = PROMPT + step
        for layer, heads in enumerate(layers):
            for head, got in enumerate(heads):
                want = set(range(SINKS)) | set(range(last - WINDOW, last)) if (layer, head) in streaming \
                    else set(range(last))
                assert got == want, f"step {step} layer {layer} head {head}: {sorted(got ^ want)}"
    want = reference(copy.deepcopy(model).double(), fed, streaming)
    full = reference(copy.deepcopy(model).double(), fed, set())
    for step, (got, expected, unmasked) in enumerate(zip(logits, want, full)):
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0, msg=f"decode forward {step}")
    assert max((e - u).abs().max() for e, u in zip(want[2:], full[2:])) > 1e-2   # the mask matters here


@pytest.mark.parametrize("settings, says", [
    (dict(streaming_share=1.5), "streaming_share must be in (0, 1]"),
    (dict(streaming_share=-0.1), "streaming_share must be in (0, 1]"),
    (dict(duo_selection="topk"), "duo_selection must be one of quantile|argsort"),
    (dict(budget=512), "evicts by a threshold with 0 < threshold <= 1"),
    (dict(duo_pattern="/no/such/pattern"), "no such file"),
    (dict(duo_pattern="{wrong}"), "2 rows x 3 gates; this model has 2 layers x 2 KV heads"),
])
def test_refusals_are_one_line(settings, says, tmp_path):
    from pyramidkv.methods import make_method

    wrong = tmp_path / "full_attention_heads.tsv"
    write_tsv(wrong, [[0.1, 0.2, 0.3]] * 2)
    settings = {k: v.replace("{wrong}", str(wrong)) if isinstance(v, str) else v for k, v in settings.items()}
    with pytest.raises(ValueError, match=re.escape(says)) as e:
        make_method("duo_attention", **settings).check_model(ModelShape(2, 4, 2, name="tiny"))
    assert "\n" not in str(e.value)


def test_packaged_pattern_is_found_by_content_and_refused_for_another_model(smollm2_path, tiny_model_dir):
    from pyramidkv.methods import make_method

    method = make_method("duo_attention")
    method.check_model(ModelShape(30, 9, 3, name=smollm2_path))
    assert method.files_read(ModelShape(30, 9, 3, name=smollm2_path))
    with pytest.raises(ValueError, match="no packaged DuoAttention pattern") as e:
        method.check_model(ModelShape(2, 4, 2, name=tiny_model_dir))
    assert "\n" not in str(e.value)
