"""`--kl_vs_fullkv`: each sample's reference answer (`Sample.reference`) is also scored teacher forced, and its row
gets the mean KL divergence of the method's next-token distributions from fullkv's over the reference's tokens
(generation/teacher_forced.py: one compressed prefill gives both the greedy answer and the distributions).

fullkv's distributions are computed once per (model, prompt, reference) and kept in
`{save_dir}/fullkv_reference/` (one safetensors file each, written atomically, named by a digest of what decides
them), so every method's run of the same sample reads the same reference; fullkv's own run writes it from its pass
(its KL is then 0 exactly).

Row fields: kl_vs_fullkv (mean over the reference's tokens, nats), kl_tokens, prefill_ms (the prompt's forward,
compression included), decode_ms_per_token (mean teacher-forced decode step).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pyramidkv.components import atomic_write

REFERENCE_FOLDER = "fullkv_reference"


def check_kl_flags(args, files) -> None:
    """ValueError (one line) for what --kl_vs_fullkv cannot measure."""
    if not getattr(args, "kl_vs_fullkv", False):
        return
    for flag, given in (("--shared_context", args.shared_context), ("--question_as_decode", args.question_as_decode)):
        if given:
            raise ValueError(f"--kl_vs_fullkv scores each whole prompt's reference answer: leave out {flag}")
    if args.eval_batch_size != 1:
        raise ValueError(f"--kl_vs_fullkv scores one sample at a time: --eval_batch_size must be 1, got "
                         f"{args.eval_batch_size}")
    for sample_file in files:
        for sample in sample_file.samples:
            if sample.questions:
                raise ValueError(f"--kl_vs_fullkv: {sample.label or sample.key} asks several questions; "
                                 "it scores one reference per prompt")
            if not sample.reference:
                raise ValueError(f"--kl_vs_fullkv: {sample.label or sample.key} has no reference answer to score")


class FullkvReference:
    """fullkv's teacher-forced log-probabilities, one file per (model, prompt, reference) under `folder`."""

    def __init__(self, folder: Path, model_facts: dict):
        self.folder, self.model_facts = Path(folder), model_facts

    def path(self, prompt: list[int], reference: list[int]) -> Path:
        digest = hashlib.sha256(json.dumps([self.model_facts, prompt, reference]).encode()).hexdigest()[:32]
        return self.folder / f"{digest}.safetensors"

    def read(self, prompt, reference):
        from safetensors.torch import load_file

        path = self.path(prompt, reference)
        if not path.is_file():
            return None
        logprobs = load_file(str(path))["logprobs"]
        if logprobs.shape[0] != len(reference):
            raise ValueError(f"{path} holds {logprobs.shape[0]} reference tokens, not {len(reference)}: delete it")
        return logprobs

    def write(self, prompt, reference, logprobs) -> None:
        from safetensors.torch import save_file

        path = self.path(prompt, reference)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda temporary: save_file({"logprobs": logprobs.contiguous()}, temporary))

    def get(self, model, tokenizer, prompt, reference):
        """fullkv's log-probabilities [n, vocab], computed and kept when missing."""
        from pyramidkv.generation.teacher_forced import score_reference
        from pyramidkv.methods import make_method

        logprobs = self.read(prompt, reference)
        if logprobs is None:
            logprobs = score_reference(model, tokenizer, prompt, reference, make_method("fullkv")).logprobs
            self.write(prompt, reference, logprobs)
        return logprobs


def reference_text(tokenizer, prompt: list[int], answer: str) -> str:
    """The answer as it would follow the prompt: after a space unless the prompt ends in whitespace (RULER's answer
    prefixes end in a word, a chat template's assistant turn in a newline)."""
    ends = tokenizer.decode(prompt[-1:])
    return answer if not ends or ends[-1].isspace() or answer[:1].isspace() else " " + answer


def reference_store(args) -> FullkvReference:
    facts = {"model_path": str(args.model_path), "dtype": str(args.dtype),
             "attn_implementation": str(args.attn_implementation), "model_class": str(args.model_class)}
    return FullkvReference(Path(args.save_dir) / REFERENCE_FOLDER, facts)


def decode_scored(model, tokenizer, method, sample, sample_file, store: FullkvReference, decode_threads=None):
    """(the sample's Generation, the row fields --kl_vs_fullkv adds)."""
    from pyramidkv.generation.teacher_forced import kl_divergence, score_reference
    from pyramidkv.methods import method_spec

    prompt = list(sample.prompt)
    reference = tokenizer(reference_text(tokenizer, prompt, sample.reference), add_special_tokens=False).input_ids
    scored = score_reference(model, tokenizer, prompt, reference, method, sample.max_new_tokens,
                             sample_file.stop_token_ids, sample_file.min_new_tokens, decode_threads)
    full = store.read(prompt, reference)
    if full is None:
        if method_spec(method) == "fullkv":     # plain fullkv: its pass is the reference
            store.write(prompt, reference, scored.logprobs)
            full = scored.logprobs
        else:
            full = store.get(model, tokenizer, prompt, reference)
    kl = kl_divergence(full, scored.logprobs)
    return scored.generation, {"kl_vs_fullkv": float(kl.mean()), "kl_tokens": len(reference),
                               "prefill_ms": round(1000 * scored.prefill_seconds, 3),
                               "decode_ms_per_token": round(1000 * scored.step_seconds, 3)}
