"""A trace against fullkv's (docs/reasoning.md, "Scores"): the KL divergence of the method's next-token
distributions from fullkv's along fullkv's own trace, teacher forced (generation/teacher_forced.py, as the
leaderboard scores answers), and the step where the method's own trace first departs from fullkv's.

fullkv's trace of a sample comes from fullkv's run of the same flags in the same --save_dir (its rows keep the
token ids and a digest of what decided them); a run of fullkv itself compares its free-running distributions with
its teacher-forced ones along its own trace: two paths through the same arithmetic, so its KL is exactly 0.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional, Sequence


def trace_digest(prompt: Sequence[int], max_new_tokens: int, sampling, facts: dict) -> str:
    """What decides a trace besides the method: the prompt's ids, the length, the sampling, the model's facts."""
    decided = [list(prompt), max_new_tokens, None if sampling is None else vars(sampling), facts]
    return hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]


def departure_step(trace: Sequence[int], reference: Sequence[int]) -> Optional[int]:
    """The index of the first generated token where `trace` differs from `reference` (one ending before the other
    departs where it ends); None when they are the same."""
    for i, (a, b) in enumerate(zip(trace, reference)):
        if a != b:
            return i
    return None if len(trace) == len(reference) else min(len(trace), len(reference))


def kl_along(model, tokenizer, prompt, reference: list[int], method, reference_logprobs=None) -> dict:
    """KL(P_fullkv || P_method) per token of fullkv's trace `reference`, teacher forced after `prompt`: its mean,
    its largest and the count. reference_logprobs: fullkv's, when already at hand (fullkv's own run)."""
    from pyramidkv.generation.teacher_forced import kl_divergence, score_reference
    from pyramidkv.methods import make_method

    if reference_logprobs is None:
        reference_logprobs = score_reference(model, tokenizer, prompt, reference, make_method("fullkv")).logprobs
    mine = score_reference(model, tokenizer, prompt, reference, method).logprobs
    kl = kl_divergence(reference_logprobs, mine)
    return {"kl_vs_fullkv": float(kl.mean()), "kl_max": float(kl.max()), "kl_tokens": len(reference)}
