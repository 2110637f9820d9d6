"""R-KV: the engine's kept sets against a float64 step-by-step simulation of the authors' rule
(github.com/Zefan-Cai/R-KV, r1_kv.py / utils.py / modeling.py, written here from their description in
pyramidkv/methods/rkv.py) on a tiny random Llama, at every forward and in every layer and KV head; a left-padded
batch of three equals each prompt alone; the bytes stay below fullkv's; bad settings are refused in one line."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from pyramidkv import make_method
from pyramidkv.generation import generate
from tests.engine_snapshot import assert_batch_equals_alone
from tests.helpers import TokenIds, float64_tiny_llama

# P = 1 (mod INTERVAL) and P >= BUDGET: the authors' firing phase (the running count 1 mod their divide_length)
# and the engine's (a head holding BUDGET + INTERVAL) then coincide, so the simulation follows theirs literally.
PROMPT, BUDGET, INTERVAL, WINDOW, STEPS = 49, 24, 16, 8, 56


def authors_selection(keys: torch.Tensor, queries: torch.Tensor, budget: int, window: int, mix: float,
                      threshold: float = 0.5, kernel: int = 7) -> tuple[list[int], bool, bool]:
    """One KV head's compression in float64. keys [m, D] in position order; queries [g, w, D], the group's last w
    queries. Returns the kept indices, whether a row found a near-duplicate, whether the redundancy changed the
    choice (against importance alone)."""
    m, dim = keys.shape
    before = m - window
    logits = torch.stack([q @ keys.T / math.sqrt(dim) for q in queries]).max(dim=0).values   # [w, m]: max over group
    attention = torch.softmax(logits[:, :before], dim=-1).mean(dim=0)                       # [before]
    half = kernel // 2
    pooled = torch.tensor([attention[max(0, j - half): j + half + 1].max().item() for j in range(before)],
                          dtype=torch.float64)
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    cos = unit @ unit.T
    cos.fill_diagonal_(0.0)
    found = False
    for i in range(m):
        similar = [j for j in range(m) if cos[i, j] > threshold]
        found |= bool(similar)
        cos[i, max(similar) if similar else 0] = 0.0
    spread = torch.softmax(cos.mean(dim=0), dim=-1)[:before]
    final = mix * pooled - (1 - mix) * spread

    def top(score):
        order = sorted(range(before), key=lambda j: (-score[j].item(), -j))   # ties: the more recent
        return sorted(order[: budget - window])

    chosen = top(final)
    return chosen + list(range(before, m)), found, chosen != top(pooled)


def simulate(model, tokens: list[int], prompt_len: int, budget: int, interval: int, window: int, mix: float):
    """The authors' cache in float64, from the model's weights: per forward (the prompt, then one token each), per
    layer, per KV head the kept positions. Each KV head attends over its own kept positions and the new ones;
    then, at prefill when the prompt holds >= budget, and at a decode forward whose token's position is 0 mod
    interval (the running count 1 mod interval) when the head holds >= budget, it keeps budget by
    `authors_selection`, the last `window` queries (the newest included) as the window."""
    m = model.model
    heads, kv_heads = model.config.num_attention_heads, model.config.num_key_value_heads
    group = heads // kv_heads
    layers = len(m.layers)
    all_k = [None] * layers
    all_v = [None] * layers
    recent_q = [None] * layers
    kept = [[[] for _ in range(kv_heads)] for _ in range(layers)]
    history, duplicates, redundancy_mattered = [], False, False
    chunks = [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]
    start = 0
    with torch.no_grad():
        for chunk in chunks:
            q_len = len(chunk)
            positions = torch.arange(start, start + q_len)
            h = m.embed_tokens(torch.tensor([chunk]))
            cos, sin = m.rotary_emb(h, positions[None])
            for layer, block in enumerate(m.layers):
                attn = block.self_attn
                x = block.input_layernorm(h)
                q = attn.q_proj(x).view(1, q_len, heads, -1).transpose(1, 2)
                k = attn.k_proj(x).view(1, q_len, kv_heads, -1).transpose(1, 2)
                v = attn.v_proj(x).view(1, q_len, kv_heads, -1).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                all_k[layer] = k[0] if all_k[layer] is None else torch.cat([all_k[layer], k[0]], dim=1)
                all_v[layer] = v[0] if all_v[layer] is None else torch.cat([all_v[layer], v[0]], dim=1)
                joined = q[0] if recent_q[layer] is None else torch.cat([recent_q[layer], q[0]], dim=1)
                recent_q[layer] = joined[:, -window:]                                  # the query cache
                outputs = []
                for head in range(heads):
                    g = head // group
                    held = kept[layer][g] + positions.tolist()
                    keys, values = all_k[layer][g, held], all_v[layer][g, held]
                    logits = q[0, head] @ keys.T / math.sqrt(keys.shape[-1])
                    visible = torch.tensor(held)[None, :] <= positions[:, None]
                    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
                    outputs.append(probs @ values)
                out = torch.stack(outputs).transpose(0, 1).reshape(1, q_len, -1)
                h = h + attn.o_proj(out)
                h = h + block.mlp(block.post_attention_layernorm(h))
                fires = start == 0 or start % interval == 0
                for g in range(kv_heads):
                    held = kept[layer][g] + positions.tolist()
                    if fires and len(held) >= budget:
                        chosen, found, mattered = authors_selection(
                            all_k[layer][g, held], recent_q[layer][g * group:(g + 1) * group], budget, window, mix)
                        duplicates |= found
                        redundancy_mattered |= mattered
                        held = [held[j] for j in chosen]
                    kept[layer][g] = held
            history.append([[set(s) for s in per_layer] for per_layer in kept])
            start += q_len
    return history, duplicates, redundancy_mattered


@pytest.fixture(scope="module")
def tiny():
    with float64_tiny_llama() as model:
        yield model


def engine_kept(model, prompt: list[int], method, steps: int):
    """Per forward: per layer, per KV head the held positions; and the tokens fed."""
    held, fed = [], []

    def record(module, args, kwargs, output):
        cache = kwargs["past_key_values"]
        held.append([[set(p.tolist()) for p in cache.held_positions(layer, 0)] for layer in range(len(cache.layers))])
        fed.extend(kwargs["input_ids"][0].tolist())

    hook = model.register_forward_hook(record, with_kwargs=True)
    try:
        out = generate(model, TokenIds(), [prompt], method, steps + 1, stop_token_ids=[])
    finally:
        hook.remove()
    return held, fed, out[0]


@pytest.mark.parametrize("mix", [0.07, 0.5])
def test_kept_sets_follow_the_authors_rule_step_by_step(tiny, mix):
    prompt = torch.randint(3, 96, (PROMPT,), generator=torch.Generator().manual_seed(5)).tolist()
    method = make_method("rkv", budget=BUDGET, decode_interval=INTERVAL, mix_lambda=mix)
    assert method.window_size == WINDOW and method.decode.decode_budget == BUDGET
    held, fed, _ = engine_kept(tiny, prompt, method, STEPS)
    assert fed[:PROMPT] == prompt and len(held) == STEPS + 1
    expected, duplicates, mattered = simulate(tiny, fed, PROMPT, BUDGET, INTERVAL, WINDOW, mix)
    for step, (got, want) in enumerate(zip(held, expected)):
        for layer, (a, b) in enumerate(zip(got, want)):
            assert a == b, f"forward {step}, layer {layer}: held sets differ by {[sorted(x ^ y) for x, y in zip(a, b)]}"
    # The case is not vacuous: three decode-time compressions, near-duplicates found, the redundancy decided.
    assert sum(len(s) == BUDGET for s in (want[0][0] for want in expected[1:])) >= 3
    assert duplicates and mattered


def test_a_batch_of_three_equals_single_runs(random_llama, request):
    model, tokenizer, _ = random_llama
    generator = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 1000, (n,), generator=generator).tolist() for n in (70, 41, 20)]
    method = make_method("rkv", budget=32, decode_interval=8)
    assert_batch_equals_alone(model, tokenizer, method, prompts, 20, request)


def test_bytes_stay_below_fullkv(tiny):
    prompt = torch.randint(3, 96, (PROMPT,), generator=torch.Generator().manual_seed(6)).tolist()
    ours = generate(tiny, TokenIds(), [prompt], make_method("rkv", budget=BUDGET, decode_interval=INTERVAL), 40,
                    stop_token_ids=[])[0]
    full = generate(tiny, TokenIds(), [prompt], make_method("fullkv"), 40, stop_token_ids=[])[0]
    assert ours.kv_bytes_per_prompt < full.kv_bytes_per_prompt
    # 2 layers x 2 KV heads x head_dim 16 x K and V x 8 bytes a float64, per held token; fullkv holds all 49 + 40 - 1.
    per_token = 2 * 2 * 16 * 2 * 8
    assert full.kv_bytes_per_prompt == (PROMPT + 40 - 1) * per_token
    assert ours.kv_bytes_per_prompt <= (BUDGET + INTERVAL) * per_token


@pytest.mark.parametrize("settings, fragment", [
    (dict(budget=32, mix_lambda=1.5), r"mix_lambda must be a number in \[0, 1\]"),
    (dict(budget=32, mix_lambda=-0.1), r"mix_lambda must be a number in \[0, 1\]"),
    (dict(budget=32, kernel_size=4), "kernel_size must be a positive odd integer"),
    (dict(budget=32, similarity_threshold=2.0), r"similarity_threshold must be a cosine similarity in \[-1, 1\]"),
    (dict(budget=32, window_size=0), "rkv needs window_size >= 1"),
    (dict(budget=32, decode_budget=None), "decode_budget=None would never evict"),
    (dict(budget_ratio=0.5), "needs decode_budget"),
])
def test_refusals_are_one_line(settings, fragment):
    with pytest.raises(ValueError, match=fragment) as error:
        make_method("rkv", **settings)
    assert "\n" not in str(error.value)
