"""Compute per-head importance scores from needle-in-a-haystack probes (the tables HeadKV allocates with).

Two scores, both accumulated while the model greedily decodes its answer with
eager attention, from the newest token's attention row of every (layer, query head):

* retrieval (Wu et al. 2024, "Retrieval Head Mechanistically Explains Long-Context
  Factuality"): +1/needle_length when the row's argmax lies in the needle span AND
  the prompt token there equals the token just generated (a copy).
* reasoning (Fu et al. 2024, HeadKV's retrieval-reasoning score): for each of the
  row's top-(needle_length) positions inside the needle span,
  +10 x attention / (needle_length x answer_tokens); no copy condition.

One score per probe and head. Probes are built with our needle code
(`pyramidkv.benchmarks.needle.NeedleHaystack`), each with its own needle so that
copying is detectable; a reasoning probe's needle holds two conditional facts and
the question picks one, so answering needs a step of reasoning over the needle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import numpy as np
import torch

from pyramidkv.benchmarks.needle import NeedleHaystack, needle_recall
from pyramidkv.generation import default_stop_token_ids
from pyramidkv.models.line import CACHE_ARGUMENT

# HeadKV's factor 10 in the retrieval-reasoning score.
REASONING_SCALE = 10.0
# A probe counts as answered when this share of the answer's key words is present (the public code: F1 or recall > 50).
ANSWERED_RECALL = 0.5

_CITIES = ("Lisbon", "Oslo", "Kyoto", "Nairobi", "Lima", "Dublin", "Hanoi", "Quebec", "Tbilisi", "Perth",
           "Seville", "Bergen")
_ACTIVITIES = ("ride a red bicycle along the harbor", "eat grilled sardines at a blue market stall",
               "read old maps in the quiet city library", "fly a green kite on the northern hill",
               "drink mint tea in the botanical garden", "watch the ferries from the stone bridge",
               "paint watercolors beside the river", "play chess with strangers in the main square",
               "visit the glass museum near the station", "swim in the cold lake at dawn",
               "bake bread with a local baker", "climb the clock tower before noon")


@dataclass
class HeadProbe:
    """One probe: a needle sentence, its question, the gold answer and where the answer starts."""
    kind: str
    needle: str
    question: str
    answer: str           # the gold continuation after answer_prefix
    answer_prefix: str    # starts the assistant's reply, so the answer is the first thing generated
    span_text: str        # the part of the needle the scores look at (its token span is the "needle span")


def make_probe(kind: str, rng: np.random.Generator) -> HeadProbe:
    """A varied needle per probe: a random city and activity (two activities for reasoning)."""
    city = str(rng.choice(_CITIES))
    first, second = (str(a) for a in rng.choice(_ACTIVITIES, size=2, replace=False))
    if kind == "retrieval":
        needle = f"The best thing to do in {city} is to {first}."
        return HeadProbe(kind, needle, f"What is the best thing to do in {city}?", first,
                         f"The best thing to do in {city} is to", span_text=first)
    if kind == "reasoning":
        rainy_first = bool(rng.integers(2))
        weather = ("rainy", "sunny") if rainy_first else ("sunny", "rainy")
        needle = (f"In {city}, the best thing to do on a {weather[0]} day is to {first}, "
                  f"but on a {weather[1]} day it is to {second}.")
        asked = int(rng.integers(2))
        answer = (first, second)[asked]
        return HeadProbe(kind, needle,
                         f"Today is a {weather[asked]} day in {city}. What is the best thing to do there today?",
                         answer, f"Today the best thing to do in {city} is to", span_text=needle)
    raise ValueError(f"unknown probe kind {kind!r}; choose retrieval or reasoning")


# --------------------------------------------------------------------------------------------
# The two scoring rules, one decode step at a time
# --------------------------------------------------------------------------------------------

def retrieval_step_scores(attention: torch.Tensor, generated_token: int, prompt_ids: Sequence[int],
                          needle_span: tuple[int, int]) -> np.ndarray:
    """Wu et al.'s retrieval score of one decode step: [layers, heads] of 0 or 1/needle_length.

    attention: [layers, heads, keys], the newest token's attention row per head.
    A head scores when its argmax key is in [start, end) and prompt_ids there == generated_token.
    """
    start, end = needle_span
    top = attention.argmax(dim=-1)                                   # [layers, heads]
    in_span = (top >= start) & (top < end)
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    token_at_top = ids[top.clamp(max=len(ids) - 1)]                  # [layers, heads]; keys past the prompt are generated
    copied = in_span & (token_at_top == int(generated_token))
    return copied.double().numpy() / (end - start)


def reasoning_step_scores(attention: torch.Tensor, needle_span: tuple[int, int], answer_tokens: int) -> np.ndarray:
    """HeadKV's retrieval-reasoning score of one decode step: [layers, heads].

    attention: [layers, heads, keys]. Sum, over the row's top-(needle_length) keys
    that lie in [start, end), of 10 x attention / (needle_length x answer_tokens).
    """
    start, end = needle_span
    needle_length = end - start
    values, idx = attention.double().topk(min(needle_length, attention.shape[-1]), dim=-1)   # [layers, heads, k]
    in_span = (idx >= start) & (idx < end)
    return (values * in_span).sum(dim=-1).numpy() * REASONING_SCALE / (needle_length * answer_tokens)


# --------------------------------------------------------------------------------------------
# Running probes
# --------------------------------------------------------------------------------------------

@dataclass
class ProbeResult:
    kind: str
    context_length: int
    depth_percent: int
    needle: str
    answer: str
    response: str
    answered: bool
    scores: np.ndarray = field(repr=False)   # [layers, heads]


def token_span(tokenizer, text: str, part: str) -> tuple[int, int]:
    """Token indices [start, end) of `part` inside the tokenization of `text` (via character offsets)."""
    begin = text.index(part)
    finish = begin + len(part)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    inside = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < finish and b > begin]
    return inside[0], inside[-1] + 1


@torch.no_grad()
def run_probe(model, tokenizer, haystack_text: str, probe: HeadProbe, context_length: int,
              depth_percent: int) -> ProbeResult:
    """Build the prompt, prefill all but its last token, then greedy-decode the answer scoring every step."""
    builder = NeedleHaystack(tokenizer, haystack_text, needle=probe.needle, question=probe.question,
                             answer_prefix=probe.answer_prefix)
    sample = builder.build(context_length, depth_percent)
    # NeedleHaystack puts "\n" needle "\n" in the context; locate span_text's tokens inside it.
    local_start, local_end = token_span(tokenizer, f"\n{probe.needle}\n", probe.span_text)
    offset = sample.prefix_tokens + sample.needle_start
    span = (offset + local_start, offset + local_end)
    if tokenizer.decode(sample.input_ids[span[0]:span[1]]).strip() not in f"\n{probe.needle}\n":
        raise RuntimeError("the needle span does not decode to needle text; the tokenizer splits it differently")

    answer_tokens = len(tokenizer(" " + probe.answer, add_special_tokens=False).input_ids)
    device = next(model.parameters()).device
    ids = torch.tensor([sample.input_ids], device=device)
    from transformers import DynamicCache

    past = DynamicCache()   # filled in place, under the line's name for a forward's cache (models/line.py)
    model(input_ids=ids[:, :-1], use_cache=True, **{CACHE_ARGUMENT: past})
    step_input = ids[:, -1:]
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    scores = np.zeros((layers, heads))                                # [layers, heads]
    stop_ids = set(default_stop_token_ids(model, tokenizer))   # eos ids (an int or a list) and the end of turn
    generated: list[int] = []
    for _ in range(answer_tokens):
        out = model(input_ids=step_input, use_cache=True, output_attentions=True, **{CACHE_ARGUMENT: past})
        token = int(out.logits[0, -1].argmax())
        # out.attentions: layers x [1, heads, 1, keys] -> [layers, heads, keys]
        attention = torch.stack([a[0, :, -1, :] for a in out.attentions]).float().cpu()
        if probe.kind == "retrieval":
            scores += retrieval_step_scores(attention, token, sample.input_ids, span)
        else:
            scores += reasoning_step_scores(attention, span, answer_tokens)
        if token in stop_ids or "\n" in tokenizer.decode([token]):
            break
        generated.append(token)
        step_input = torch.tensor([[token]], device=device)
    response = tokenizer.decode(generated, skip_special_tokens=True).strip()
    answered = needle_recall(response, needle=probe.answer, question=None) > ANSWERED_RECALL
    return ProbeResult(probe.kind, context_length, depth_percent, probe.needle, probe.answer, response, answered,
                       scores)


def probe_grid(num_probes: int, context_lengths: Sequence[int], rng: np.random.Generator) -> list[tuple[int, int]]:
    """(context_length, depth_percent) per probe: lengths cycle, depths spread evenly over 0..100 per length."""
    if num_probes < 1:
        raise ValueError(f"num_probes must be >= 1, got {num_probes}")
    if not context_lengths:
        raise ValueError("context_lengths must not be empty")
    cells = []
    for i in range(num_probes):
        length = context_lengths[i % len(context_lengths)]
        per_length = -(-num_probes // len(context_lengths))
        slot = i // len(context_lengths)
        depth = int(round(100 * (slot + rng.random()) / per_length))
        cells.append((int(length), min(depth, 100)))
    return cells


def compute_head_scores(model, tokenizer, haystack_text: str, kind: str, num_probes: int,
                        context_lengths: Sequence[int], seed: int = 0,
                        on_probe: Optional[Callable[[ProbeResult], None]] = None) -> list[ProbeResult]:
    """Run `num_probes` probes of `kind`; the caller turns them into the HeadKV layout (`as_headkv_dict`)."""
    rng = np.random.default_rng(seed)
    results = []
    for length, depth in probe_grid(num_probes, context_lengths, rng):
        result = run_probe(model, tokenizer, haystack_text, make_probe(kind, rng), length, depth)
        results.append(result)
        if on_probe is not None:
            on_probe(result)
    return results


def as_headkv_dict(results: Sequence[ProbeResult]) -> dict[str, list[float]]:
    """HeadKV's layout: {"layer-head": [score of each probe]}, row-major over (layer, query head)."""
    stacked = np.stack([r.scores for r in results], axis=-1)          # [layers, heads, probes]
    layers, heads, _ = stacked.shape
    return {f"{l}-{h}": [float(s) for s in stacked[l, h]] for l in range(layers) for h in range(heads)}
