"""Quantized KV storage in the cache (core/quantized.py) on SmolLM2: stored bytes against the formula, KIVI
windowing against the quantizer applied to the tokens the cache was given, decode attention against
transformers' attention over a DynamicCache of the dequantized tensors, batches, bad inputs.

The references are written here: the byte formula from counts and settings; the expected stored tensors
from the recorded full-precision inputs and the quantizer units (tested on their own against numpy in
test_quantization.py); the reference attention is the unpatched model's own (sdpa over a DynamicCache).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import DynamicCache

from pyramidkv import compress, make_method
from pyramidkv.core.quantized import QuantizedStore
from pyramidkv.generation import generate
from pyramidkv.quantization import KIVIQuantizer
from tests.helpers import ROOT
from tests.prompts import STORY, passkey_prompt

HEAD_DIM = 64          # SmolLM2-135M
FP32 = 4


def story_ids(tokenizer):
    return tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids


@torch.no_grad()
def decode(model, ids, method, steps, each_step=None):
    """Prefill `ids`, then `steps` greedy tokens one by one; each_step(cache, step) after every forward
    (step 0: after prefill). Returns (cache, the last token fed, the logits of the last forward)."""
    with compress(model, method) as patch:
        cache = patch.new_cache()
        out = model(ids, past_key_values=cache, use_cache=True)
        if each_step:
            each_step(cache, 0)
        token = fed = out.logits[:, -1:].argmax(-1)
        for step in range(1, steps + 1):
            fed = token
            out = model(fed, past_key_values=cache, use_cache=True)
            token = out.logits[:, -1:].argmax(-1)
            if each_step:
                each_step(cache, step)
    return cache, fed, out.logits[0, -1]


# ---- bytes --------------------------------------------------------------------------------------------
def kivi_bytes(tokens: int, nbits: int, group: int, residual: int, elem: int = FP32, dim: int = HEAD_DIM) -> int:
    """One stored head holding `tokens` tokens under KIVI windowing (group size divisible by 4)."""
    quantized = group * (max(0, tokens - residual) // group)
    codes = 2 * quantized * dim * nbits // 8                       # keys and values
    key_scales = dim * (quantized // group) * 2 * 2                # fp16 scale + zero per channel per group
    value_scales = quantized * (dim // group) * 2 * 2              # fp16 scale + zero per token per group
    return codes + key_scales + value_scales + (tokens - quantized) * dim * elem * 2


@pytest.mark.parametrize("nbits", [2, 4, 8])
@pytest.mark.parametrize("name,settings", [("fullkv", {}), ("snapkv", {"budget": 95, "window_size": 16}),
                                           ("adakv", {"budget": 95, "window_size": 16})])
def test_kv_bytes_equal_the_formula_at_every_step(smollm2, name, settings, nbits):
    model, tokenizer = smollm2
    group, residual = 16, 32
    method = make_method(name, quant_method="kivi", nbits=nbits, group_size=group, residual_length=residual,
                         **settings)
    layers = model.config.num_hidden_layers
    checked = []

    def check(cache, step):
        counts = [cache.kept_counts(layer)[0] for layer in range(layers)]
        if name == "adakv" and step == 0:
            assert any(len(set(c)) > 1 for c in counts)              # ragged heads really occur
        expected = sum(kivi_bytes(k + step, nbits, group, residual) for c in counts for k in c)
        assert cache.kv_bytes() == expected
        parts = cache.kv_bytes_breakdown()
        assert sum(parts.values()) == expected
        assert parts["outliers"] == parts["factors"] == parts["codebook"] == parts["positions"] == 0
        assert parts["residual"] == sum(FP32 * HEAD_DIM * 2 * (k + step - group * (max(0, k + step - residual) // group))
                                        for c in counts for k in c)
        checked.append(step)

    cache, _, _ = decode(model, story_ids(tokenizer), method, 8, check)   # (budget 95: a group leaves the
    assert checked == list(range(9))                                     # window at the first step)
    assert any(layer.decoded.rows > 0 for layer in cache.layers)


def test_kvquant_bytes_count_outliers_positions_and_the_sink(smollm2):
    model, tokenizer = smollm2
    group, residual = 16, 16
    method = make_method("snapkv", budget=96, window_size=16, quant_method="kvquant", nbits=4, group_size=group,
                         residual_length=residual)
    steps = 20
    cache, _, _ = decode(model, story_ids(tokenizer), method, steps)
    expected = 0
    for layer in range(model.config.num_hidden_layers):
        for positions in cache.kept_positions(layer, 0):
            sink = int((positions < 1).sum())                    # the first prompt token, where it was kept
            kept = len(positions) - sink
            at_prefill = group * (max(0, kept - residual) // group)
            quantized = group * (max(0, kept + steps - residual) // group)
            blocks = (quantized - at_prefill) // group          # groups quantized while decoding
            codes = 2 * quantized * HEAD_DIM * 4 // 8
            scales = HEAD_DIM * (quantized // group) * 4 + quantized * (HEAD_DIM // group) * 4
            # 1% per vector: a key channel over its block's tokens, a value token over its 64 channels;
            # int16 index + fp16 value each.
            key_outliers = HEAD_DIM * (math.ceil(0.01 * at_prefill) + blocks * math.ceil(0.01 * group))
            outliers = (key_outliers + quantized * math.ceil(0.01 * HEAD_DIM)) * 4
            rope = quantized * 4                                 # int32 position of each key stored before RoPE
            residual_rows = sink + kept + steps - quantized
            expected += codes + scales + outliers + rope + residual_rows * HEAD_DIM * FP32 * 2
    assert cache.kv_bytes() == expected


# ---- windowing: quantized once, in whole groups ---------------------------------------------------------
def test_tokens_are_quantized_once_in_whole_groups(smollm2, monkeypatch):
    model, tokenizer = smollm2
    group, residual, steps = 16, 32, 24
    quantizer = KIVIQuantizer(nbits=2, group_size=group, residual_length=residual)
    method = make_method("adakv", budget=96, window_size=16, quant_method=quantizer)
    layers = (0, model.config.num_hidden_layers - 1)
    given = {}   # per store (id), the full-precision K/V it was handed for prompt 0: kept prompt tokens, then appends

    real_init, real_append = QuantizedStore.__init__, QuantizedStore.append

    def spy_init(self, quantizer, kept, *args, **kwargs):
        given[id(self)] = [[(k.clone(), v.clone()) for k, v in kept[0].per_head()]]
        real_init(self, quantizer, kept, *args, **kwargs)

    def spy_append(self, keys, values, rope_positions):
        given[id(self)].append([(keys[0, h].clone(), values[0, h].clone()) for h in range(keys.shape[1])])
        real_append(self, keys, values, rope_positions)

    monkeypatch.setattr(QuantizedStore, "__init__", spy_init)
    monkeypatch.setattr(QuantizedStore, "append", spy_append)
    snapshots = {}

    def check(cache, step):
        for layer in layers:
            store = cache.layers[layer]
            handed = given[id(store)]
            window = store.fp_len - store.sink
            total = torch.tensor([k + step for k in cache.kept_counts(layer)[0]])
            assert int(window.max()) <= residual + group - 1
            assert torch.equal(window, torch.where(total < residual, total, residual + (total - residual) % group))
            if step % 4 and step != steps:                          # the stored tensors: every 4th step
                continue
            for h, (_, keys, values) in enumerate(cache.stored_kv(layer, 0)):
                original_keys = torch.cat([handed[0][h][0]] + [s[h][0] for s in handed[1:]])
                original_values = torch.cat([handed[0][h][1]] + [s[h][1] for s in handed[1:]])
                n = original_keys.shape[0]
                assert keys.shape[0] == n == int(total[h])
                q = group * (max(0, n - residual) // group)
                want_keys = quantizer.quantize_keys(original_keys[None, :q]).dequantize()[0] if q else keys[:0]
                want_values = quantizer.quantize_values(original_values[None, :q]).dequantize()[0] if q else keys[:0]
                torch.testing.assert_close(keys[:q], want_keys, rtol=1e-6, atol=1e-5)
                torch.testing.assert_close(values[:q], want_values, rtol=1e-6, atol=1e-5)
                assert torch.equal(keys[q:], original_keys[q:]) and torch.equal(values[q:], original_values[q:])
                snapshots.setdefault((layer, h), []).append((q, keys[:q].clone(), values[:q].clone()))

    cache, _, _ = decode(model, story_ids(tokenizer), method, steps, check)
    for layer in layers:
        assert cache.layers[layer].decoded.rows > 0             # groups were quantized while decoding
    for history in snapshots.values():
        last_q, last_keys, last_values = history[-1]
        for q, keys, values in history:                             # what was quantized stays bit for bit
            assert torch.equal(last_keys[:q], keys) and torch.equal(last_values[:q], values)


# ---- attention over the quantized cache ----------------------------------------------------------------
@pytest.mark.parametrize("quant", [dict(quant_method="kivi", nbits=2, group_size=16, residual_length=32),
                                   dict(quant_method="kvquant", nbits=4, group_size=16, residual_length=16),
                                   dict(quant_method="gear", nbits=2, group_size=16, residual_length=32)],
                         ids=["kivi2", "kvquant4", "gear2"])
def test_decode_attention_equals_transformers_over_the_dequantized_cache(smollm2, quant):
    model, tokenizer = smollm2
    method = make_method("snapkv", budget=96, window_size=16, **quant)
    ids = story_ids(tokenizer)
    steps = 20                                        # a group leaves the window while decoding
    cache, fed, logits = decode(model, ids, method, steps)
    assert cache.layers[0].decoded.rows > 0
    reference = DynamicCache()
    position = ids.shape[1] + steps - 1               # of the last token fed
    for layer in range(model.config.num_hidden_layers):
        heads = cache.stored_kv(layer, 0)
        for positions, _, _ in heads:
            assert int(positions[-1]) == position     # the newest stored token is the one just fed
        keys = torch.stack([k[:-1] for _, k, _ in heads])[None]     # [1, H, n, D], all but that token
        values = torch.stack([v[:-1] for _, _, v in heads])[None]
        reference.update(keys, values, layer)
    with torch.no_grad():
        expected = model(fed, past_key_values=reference, position_ids=torch.tensor([[position]]),
                         use_cache=True).logits[0, -1]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=2e-4)


def test_ragged_decode_attention_equals_a_dense_softmax_per_head(smollm2):
    model, tokenizer = smollm2
    method = make_method("adakv", budget=96, window_size=16, quant_method="kivi", nbits=2, group_size=16,
                         residual_length=32)
    cache, _, _ = decode(model, story_ids(tokenizer), method, 18)
    generator = torch.Generator().manual_seed(0)
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    for layer in (0, 7, cfg.num_hidden_layers - 1):
        assert len(set(cache.kept_counts(layer)[0])) > 1
        queries = torch.randn(1, cfg.num_attention_heads, 1, HEAD_DIM, generator=generator)
        got = cache.layers[layer].attend(queries)
        for h, (_, keys, values) in enumerate(cache.stored_kv(layer, 0)):
            for j in range(group):
                q = queries[0, h * group + j, 0].double()
                weights = torch.softmax(keys.double() @ q / HEAD_DIM ** 0.5, dim=0)
                torch.testing.assert_close(got[0, h * group + j, 0].double(), weights @ values.double(),
                                           rtol=1e-5, atol=1e-5)


def test_kivi_8bit_reproduces_fullkv_on_the_pass_key(smollm2):
    model, tokenizer = smollm2
    prompt = passkey_prompt(73691, 60, depth=0.5)
    full = generate(model, tokenizer, [prompt], make_method("fullkv"), 20, min_new_tokens=20)[0]
    quantized = generate(model, tokenizer, [prompt], make_method("fullkv", quant_method="kivi", nbits=8), 20,
                         min_new_tokens=20)[0]
    assert "73691" in full.text
    assert quantized.text == full.text
    assert quantized.kv_bytes_per_prompt < 0.45 * full.kv_bytes_per_prompt


def test_left_padded_batch_equals_single_prompts_under_kivi2(smollm2):
    model, tokenizer = smollm2
    prompts = [passkey_prompt(41872, 12), STORY, passkey_prompt(90311, 0)]
    lengths = [len(tokenizer(p, add_special_tokens=False).input_ids) for p in prompts]
    assert len(set(lengths)) == 3 and min(lengths) < 127 < max(lengths)     # one prompt is kept whole
    # 127 kept: 64 quantized at prefill, 63 in the window, so a group leaves it at the first step.
    method = make_method("snapkv", budget=127, window_size=16, quant_method="kivi", nbits=2, residual_length=32)
    single = [generate(model, tokenizer, [p], method, 12, min_new_tokens=12)[0] for p in prompts]
    batch = generate(model, tokenizer, prompts, method, 12, min_new_tokens=12)
    for s, b in zip(single, batch):
        assert b.text == s.text
        assert b.kv_bytes_per_prompt == s.kv_bytes_per_prompt
    assert single[0].kv_bytes_per_prompt != single[2].kv_bytes_per_prompt


# ---- settings, bad input, runners --------------------------------------------------------------------
def test_method_carries_the_quantizer():
    method = make_method("snapkv", budget=256, quant_method="kivi", nbits=4)
    assert method.quant_method == KIVIQuantizer(nbits=4)
    assert method.describe()["quant_method"] == {"name": "kivi", "nbits": 4, "group_size": 32, "residual_length": 128}
    assert make_method("snapkv", budget=256).describe()["quant_method"] is None
    assert make_method("fullkv", quant_method="kivi").quant_method == KIVIQuantizer()
    assert make_method("snapkv", budget=64, quant_method=KIVIQuantizer(nbits=8)) == \
        make_method("snapkv", budget=64, quant_method="kivi", nbits=8)


@pytest.mark.parametrize("settings,message", [
    (dict(quant_method="kivi", nbits=3), "nbits must be one of 2, 4, 8"),
    (dict(quant_method="kivi", residual_length=100), "residual_length must be a multiple of group_size 32"),
    (dict(quant_method="gear", group_size=64, residual_length=32), "residual_length must be a multiple of group_size 64"),
    (dict(quant_method="kivi", group_size=0), "group_size must be >= 1"),
    (dict(quant_method="int4"), "unknown quantizer 'int4'"),
    (dict(nbits=2), "nbits is a setting of the quantizer kivi / kvquant / gear, but snapkv has no quant_method"),
    (dict(quant_method="kivi", rank=2), "rank is a setting of the quantizer gear, not of kivi; choose quant_method='gear'"),
])
def test_bad_quantization_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        make_method("snapkv", budget=64, **settings)


def test_group_size_must_divide_the_head_dim_when_the_cache_is_built(smollm2):
    model, _ = smollm2
    method = make_method("snapkv", budget=64, quant_method="kivi", group_size=48, residual_length=96)
    with pytest.raises(ValueError, match="group_size 48 does not divide head_dim 64"):
        compress(model, method)
    assert getattr(model, "_pyramidkv_patch", None) is None


def _ruler_args(model_dir, save_dir, *extra):
    return ["--model_path", model_dir, "--method", "snapkv", "--max_capacity_prompts", "64", "--save_dir", str(save_dir),
            "--num_threads", "1", "--device", "cpu", "--tasks", "niah_single_1", "--context_lengths", "256",
            "--num_samples", "1", *extra]


def _cli_error(main, argv, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_cli_quantization_flags_reach_the_method_and_get_their_own_folder(tiny_model_dir, tmp_path, capsys):
    from pyramidkv.benchmarks.ruler.run import main

    flags = ("--quant_method", "kivi", "--nbits", "4", "--q_group_size", "16", "--quant_residual_length", "32")
    assert main(_ruler_args(tiny_model_dir, tmp_path, *flags)) == 0
    assert main(_ruler_args(tiny_model_dir, tmp_path)) == 0
    budget_dir = next(tmp_path.glob("*_64"))
    label = "snapkv_quant_method=kivi-nbits=4-group_size=16-residual_length=32"
    assert sorted(p.name for p in budget_dir.iterdir()) == ["snapkv", label]
    meta = json.loads((budget_dir / label / "run_meta.json").read_text())
    assert meta["method"]["quant_method"] == {"name": "kivi", "nbits": 4, "group_size": 16, "residual_length": 32}
    assert json.loads((budget_dir / "snapkv" / "run_meta.json").read_text())["method"]["quant_method"] is None

    err = _cli_error(main, _ruler_args(tiny_model_dir, tmp_path, "--quant_method", "kivi", "--nbits", "3"), capsys)
    assert "nbits must be one of 2, 4, 8" in err
    err = _cli_error(main, _ruler_args(tiny_model_dir, tmp_path, "--quant_method", "kivi", "--q_group_size", "32",
                                       "--quant_residual_length", "48"), capsys)
    assert "residual_length must be a multiple of group_size 32" in err
    err = _cli_error(main, _ruler_args(tiny_model_dir, tmp_path, "--quant_method", "kivi"), capsys)
    assert "group_size 32 does not divide head_dim 16" in err          # the tiny model's head dim
    err = _cli_error(main, _ruler_args(tiny_model_dir, tmp_path, "--nbits", "2"), capsys)
    assert "snapkv has no quant_method" in err
    err = _cli_error(main, _ruler_args(tiny_model_dir, tmp_path, "--quant_method", "int4"), capsys)
    assert "invalid choice: 'int4'" in err
    assert sorted(p.name for p in budget_dir.iterdir()) == ["snapkv", label]   # nothing written for bad input


def test_sweep_runs_quantized_variants_and_the_quantized_full_cache():
    import os
    import subprocess

    env = {**os.environ, "METHODS": "snapkv", "BUDGETS": "256", "VARIANTS": "-|--quant_method kivi --nbits 2",
           "FULLKV_VARIANTS": "-|--quant_method kivi --nbits 2", "PYTHON": "echo"}
    got = subprocess.run(["bash", "-c", 'source scripts/sweep_tasks.sh; for t in "${SWEEP_TASKS[@]}"; do '
                          'run_sweep_task ruler "$t" --save_dir out; done'], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    assert got.returncode == 0, got.stderr
    assert got.stdout.splitlines() == [
        "run_ruler.py --method fullkv --save_dir out",
        "run_ruler.py --method fullkv --quant_method kivi --nbits 2 --save_dir out",
        "run_ruler.py --method snapkv --max_capacity_prompts 256 --save_dir out",
        "run_ruler.py --method snapkv --max_capacity_prompts 256 --quant_method kivi --nbits 2 --save_dir out"]


def test_benchmark_reports_bytes_by_part_and_the_fp16_ratio(tiny_model_dir, tmp_path):
    import os
    import subprocess
    import sys

    root = ROOT
    out = tmp_path / "bench.json"
    quantized = "fullkv:quant_method=kivi,group_size=16,residual_length=32"
    subprocess.run([sys.executable, str(root / "measure" / "benchmark_latency_memory.py"), "--model_path", tiny_model_dir,
                    "--device", "cpu", "--context_length", "96", "--max_capacity_prompts", "40", "--new_tokens", "2",
                    "--repeats", "1", "--threads", "1", "--methods", "fullkv", quantized, "--out", str(out)],
                   check=True, cwd=root, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)})
    rows = json.loads(out.read_text())["results"]
    row = rows[quantized]
    # Per stored head (2 layers x 2 KV heads, head dim 16): 64 of 96 tokens quantized at 2 bits, 32 in fp32.
    codes, scales = 2 * 64 * 16 * 2 // 8, 16 * 4 * 2 + 64 * 1 * 2
    assert (row["kv_bytes_codes"], row["kv_bytes_scales"], row["kv_bytes_zeros"]) == (4 * codes, 4 * scales, 4 * scales)
    assert row["kv_bytes_residual"] == 4 * 32 * 16 * 2 * 4
    assert row["kv_bytes_after_prefill"] == 4 * (codes + 2 * scales + 32 * 16 * 2 * 4)
    fp16_full = 4 * 96 * 16 * 2 * 2
    assert rows["fullkv"]["kv_bytes_fp16"] == fp16_full
    assert row["kv_ratio_fp16"] == row["formula_kv_ratio_fp16"] == 4 * (codes + 2 * scales + 32 * 16 * 2 * 2) / fp16_full
    assert row["decode_ratio_unquantized"] == row["decode_s_per_token"] / rows["fullkv"]["decode_s_per_token"]


def test_kvquant_quantizes_keys_before_rope(smollm2):
    """The quantized keys are the k_proj outputs (captured by a hook, before RoPE); read back, the keys
    are the model's post-RoPE keys (an unpatched DynamicCache run), both up to 8-bit rounding."""
    model, tokenizer = smollm2
    ids = story_ids(tokenizer)
    layer = 5
    captured = []
    hook = model.model.layers[layer].self_attn.k_proj.register_forward_hook(lambda m, i, o: captured.append(o))
    try:
        with torch.no_grad():
            plain = model(ids, use_cache=True).past_key_values
    finally:
        hook.remove()
    heads = model.config.num_key_value_heads
    before_rope = captured[0][0].view(ids.shape[1], heads, HEAD_DIM).transpose(0, 1)      # [H, n, D]
    after_rope = plain[layer][0][0]                                                        # [H, n, D]
    method = make_method("fullkv", quant_method="kvquant", nbits=8, group_size=16, residual_length=16)
    cache, _, _ = decode(model, ids, method, 0)
    store = cache.layers[layer]
    (group,) = store.prefill
    tokens = group.tokens
    assert int(store.sink.min()) == 1 and tokens > 100                 # token 0 is the sink, in full precision
    bound = 0.01 * float(before_rope.abs().max())
    torch.testing.assert_close(group.keys.dequantize(), before_rope[:, 1:1 + tokens], atol=bound, rtol=0)
    for h, (positions, keys, _) in enumerate(cache.stored_kv(layer, 0)):
        assert torch.equal(positions, torch.arange(ids.shape[1]))
        assert torch.equal(keys[0], after_rope[h, 0])                  # the sink: exactly as the model made it
        torch.testing.assert_close(keys, after_rope[h], atol=bound, rtol=0)


def test_quantized_storage_refuses_decode_time_compression():
    with pytest.raises(ValueError, match="decode_budget .* does not combine with quant_method='kivi'"):
        make_method("snapkv", budget=128, decode_budget=256, quant_method="kivi")
