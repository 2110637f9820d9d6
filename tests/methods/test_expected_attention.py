"""Expected Attention against its rule written out in float64 with explicit RoPE matrices: the queries before RoPE
and the keys from the model's own projections (not the engine's), R_j = diag(cos_j) + P diag(sin_j) built from
the frequencies, R = the mean of R_j over the next n_future_positions positions."""

from __future__ import annotations

import pytest
import torch

from pyramidkv import compress
from pyramidkv.core.context import DecodeScoreContext
from pyramidkv.core.prefill import PromptCompressor
from pyramidkv.methods import make_method, method_spec, parse_method_spec
from pyramidkv.methods.expected_attention import ExpectedAttention, mean_rotation
from pyramidkv.models.patch import MODEL_GLUE


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Many small float64 operations: more threads only wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def rope_matrix(position: int, dim: int, theta: float) -> torch.Tensor:
    """[D, D] float64 R_j of the rotate_half convention: x -> x * cos + rotate_half(x) * sin."""
    freqs = position / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    cos, sin = torch.cat([freqs, freqs]).cos(), torch.cat([freqs, freqs]).sin()
    half = dim // 2
    turn = torch.zeros(dim, dim, dtype=torch.float64)   # P x = [-x[half:], x[:half]]
    turn[:half, half:] = -torch.eye(half, dtype=torch.float64)
    turn[half:, :half] = torch.eye(half, dtype=torch.float64)
    return torch.diag(cos) + turn @ torch.diag(sin)


def reference(rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, theta: float, first_future: int,
              future: int = 512, sinks: int = 4, epsilon: float = 0.0) -> torch.Tensor:
    """The rule on one prompt without padding, float64: rows [Hq, r, D] the queries the statistics count, before
    RoPE; k [Hkv, n, D] after RoPE, v [Hkv, n, D]; R the mean over first_future .. + future -> [Hq, n] (sinks 0)."""
    hq, _, dim = rows.shape
    group = hq // k.shape[0]
    mean_r = sum(rope_matrix(j, dim, theta) for j in range(first_future, first_future + future)) / future
    out = torch.zeros(hq, k.shape[1], dtype=torch.float64)
    for h in range(hq):
        mu = rows[h].mean(0)
        sigma = (rows[h] - mu).T @ (rows[h] - mu) / rows.shape[1]
        mu_f, sigma_f = mean_r @ mu, mean_r @ sigma @ mean_r.T
        keys = k[h // group, sinks:]
        z = keys @ mu_f / dim ** 0.5 + torch.einsum("nd,de,ne->n", keys, sigma_f, keys) / (2 * dim)
        out[h, sinks:] = (torch.softmax(z, 0) + epsilon) * v[h // group, sinks:].norm(dim=-1)
    return out


def projections(model, hidden: dict, n: int) -> dict:
    """Per layer (q before RoPE [Hq, n, D], k after RoPE [Hkv, n, D], v) in float64 from the layer's attention
    input `hidden` [n, hidden size] by its own projection weights."""
    config = model.config
    dim = config.hidden_size // config.num_attention_heads
    rotations = torch.stack([rope_matrix(p, dim, config.rope_theta) for p in range(n)])   # [n, D, D]
    out = {}
    for layer, h in hidden.items():
        attn = model.model.layers[layer].self_attn

        def heads(proj, count):
            return (h.double() @ proj.weight.double().T).view(n, count, dim).transpose(0, 1)

        k = heads(attn.k_proj, config.num_key_value_heads)
        out[layer] = (heads(attn.q_proj, config.num_attention_heads), torch.einsum("nde,hne->hnd", rotations, k),
                      heads(attn.v_proj, config.num_key_value_heads))
    return out


def stored_scores(monkeypatch, model, ids, mask, method, inputs: dict | None = None) -> dict[int, torch.Tensor]:
    """Per layer the stored heads' scores [B, H, n] the prefill computed; `inputs`: layer -> filled with that
    layer's attention input [n, hidden size] at the prefill (prompt 0)."""
    seen = {}
    original = PromptCompressor.score

    def record(self, layer_idx, *args, **kwargs):
        scored = original(self, layer_idx, *args, **kwargs)
        seen[layer_idx] = scored.scores.double()
        return scored

    def capture(layer):
        def hook(module, args, kwargs):
            if inputs[layer] is None:   # the prefill's, not a decode step's
                inputs[layer] = kwargs["hidden_states"][0].detach().clone()
        return hook

    hooks = [model.model.layers[layer].self_attn.register_forward_pre_hook(capture(layer), with_kwargs=True)
             for layer in (inputs or {})]
    try:
        with monkeypatch.context() as patch, compress(model, method), torch.no_grad():
            patch.setattr(PromptCompressor, "score", record)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_mean_rope_matrix_is_the_mean_of_the_explicit_matrices(random_llama):
    model = random_llama[0]
    rotation = MODEL_GLUE["llama"].key_rotation(model)
    mean = mean_rotation(rotation, 300, 512, 16, torch.device("cpu")).double()
    explicit = sum(rope_matrix(j, 16, model.config.rope_theta) for j in range(300, 812)) / 512
    torch.testing.assert_close(mean, explicit, rtol=0, atol=1e-6)
    x = torch.randn(16, dtype=torch.float64)   # R x = the mean of RoPE_j(x)
    rotated = rotation.rotate(x.float().expand(512, 1, 16), torch.arange(300, 812)[:, None]).double().mean(0)[0]
    torch.testing.assert_close(mean @ x, rotated, rtol=0, atol=1e-5)


def test_scores_equal_the_float64_rule_on_smollm2_in_both_layouts(smollm2, monkeypatch):
    model, tokenizer = smollm2
    from tests.prompts import STORY
    ids = tokenizer(STORY, return_tensors="pt", add_special_tokens=False).input_ids[:, :160]
    inputs = dict.fromkeys([0, 17, 29])
    seen = {layout: stored_scores(monkeypatch, model, ids, torch.ones_like(ids),
                                  make_method("ada_expected_attention", budget=64, gqa_layout=layout),
                                  inputs if layout == "kv_head" else None) for layout in ("kv_head", "query_head")}
    for layer, (q, k, v) in projections(model, inputs, ids.shape[1]).items():
        per_query_head = reference(q[:, 4:], k, v, model.config.rope_theta, ids.shape[1], epsilon=0.01)   # [Hq, n]
        for layout, expected in (("query_head", per_query_head),
                                 ("kv_head", per_query_head.view(k.shape[0], -1, ids.shape[1]).mean(1))):
            scale = expected.abs().max()
            torch.testing.assert_close(seen[layout][layer][0] / scale, expected / scale, rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"layer {layer}, {layout}: {m}")


def test_a_left_padded_row_scores_as_alone(random_llama, monkeypatch):
    """Pads are not in the statistics and the future positions start at the row's own length."""
    model, tokenizer, _ = random_llama
    method = make_method("expected_attention", budget=24, n_future_positions=64)
    lengths = [90, 61, 40]
    prompts = [torch.randint(3, 900, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    ids = torch.zeros(3, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, -len(p):], mask[b, -len(p):] = p, 1
    batch = stored_scores(monkeypatch, model, ids, mask, method)
    for b, p in enumerate(prompts):
        alone = stored_scores(monkeypatch, model, p[None], torch.ones(1, len(p), dtype=torch.long), method)
        for layer in alone:
            torch.testing.assert_close(batch[layer][b, :, -len(p):], alone[layer][0], rtol=1e-4, atol=1e-7)


def test_decode_scores_use_the_true_positions(random_llama):
    """At a decode-time re-selection: queries un-rotated at their true positions, future positions after the
    newest held token (not after the buffer, as kvpress)."""
    model, _, _ = random_llama
    torch.manual_seed(3)
    dim, theta, m, w = 16, model.config.rope_theta, 30, 12
    rotation = MODEL_GLUE["llama"].key_rotation(model)
    held = torch.arange(50, 50 + m)                        # true positions of the held tokens
    q_pre = torch.randn(4, w, dim, dtype=torch.float64)
    k = torch.einsum("nde,hne->hnd", torch.stack([rope_matrix(int(p), dim, theta) for p in held]),
                     torch.randn(2, m, dim, dtype=torch.float64))
    v = torch.randn(2, m, dim, dtype=torch.float64)
    q = torch.einsum("nde,hne->hnd", torch.stack([rope_matrix(int(p), dim, theta) for p in held[-w:]]), q_pre)
    ctx = DecodeScoreContext(0, 1, q[None].float(), k[None].float(), v[None].float(),
                             torch.ones(1, m, dtype=torch.bool), positions=held.expand(1, 2, m), rotation=rotation)
    method = make_method("expected_attention", budget=8, decode_budget=8, n_future_positions=32, num_sinks=2)
    got = method.decode_score(ctx)[0].double()
    # statistics over all w buffered queries (none is among the first 2 tokens), keys after the first 2 held ones
    expected = reference(q_pre, k, v, theta, first_future=50 + m, future=32, sinks=2)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)


def test_the_leaderboard_composition_is_one_name():
    method = parse_method_spec("expected_attention:budget=64,head_allocation=adakv,safeguard=first,epsilon=0.01")
    assert method_spec(method) == "ada_expected_attention:budget=64"
    paper_split = parse_method_spec("expected_attention:budget=64,head_allocation=adakv,epsilon=0.01")
    assert method_spec(paper_split) == "ada_expected_attention:budget=64,safeguard=blend"
    assert method_spec(make_method("ada_expected_attention", budget=64, head_allocation="uniform", epsilon=0.0)) == \
        "expected_attention:budget=64"
    defaults = ExpectedAttention(budget=64)
    assert (defaults.n_future_positions, defaults.num_sinks, defaults.use_covariance, defaults.use_vnorm,
            defaults.epsilon, defaults.window_size) == (512, 4, True, True, 0.0, 0)


@pytest.mark.parametrize("setting, allowed", [("n_future_positions=0", ">= 1"), ("epsilon=-0.5", ">= 0"),
                                              ("num_sinks=-1", ">= 0"), ("use_covariance=maybe", "true or false")])
def test_bad_settings_are_refused_in_one_line(setting, allowed):
    with pytest.raises(ValueError) as refusal:
        parse_method_spec(f"expected_attention:budget=64,{setting}")
    assert allowed in str(refusal.value) and setting.split("=")[0] in str(refusal.value)
    assert "\n" not in str(refusal.value)
