"""The pipeline API: a context compressed once, several questions answered from it (generation/shared.py).

    pipe = pyramidkv.pipeline(model, tokenizer)   # or transformers.pipeline("kv-compression", model=, tokenizer=)
    out = pipe(context, questions=["Who?", "When?"], method="snapkv:budget=256", max_new_tokens=32)
    out["answers"]       # one string per question
    out["stats"]         # per question: turn, kept and held bytes, time to first token, ...

A list of contexts (with one list of questions each) is answered as one batch and gives one dict per context.
With a chat template (the tokenizer's, on by default) the context opens the user turn and each question closes it
(`question + end of turn + assistant header`); under multi_turn a later question is a new user turn after the
previous answer. Without one, context and question are concatenated as they are.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from transformers import Pipeline

from pyramidkv.generation.chat import chat_frame, followup_frame
from pyramidkv.generation.shared import Answer, answer_questions, check_mode
from pyramidkv.methods import Method, make_method, parse_method_spec

TASK = "kv-compression"


class KVCompressionPipeline(Pipeline):
    """`pipe(context, questions=[...], method=..., max_new_tokens=..., mode="multi_request")`: see the module."""

    def __init__(self, *args, chat_template: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_template = bool(chat_template and getattr(self.tokenizer, "chat_template", None))

    def _sanitize_parameters(self, questions=None, question=None, method=None, max_new_tokens=None, mode=None,
                             min_new_tokens=None, stop_token_ids=None, **unknown):
        if unknown:
            raise ValueError(f"unknown argument(s) {', '.join(sorted(unknown))}; allowed: questions, question, "
                             f"method, max_new_tokens, mode, min_new_tokens, stop_token_ids")
        given = {"questions": questions, "question": question, "method": method, "max_new_tokens": max_new_tokens,
                 "mode": mode, "min_new_tokens": min_new_tokens, "stop_token_ids": stop_token_ids}
        return {}, {k: v for k, v in given.items() if v is not None}, {}

    def __call__(self, context: Union[str, Sequence[str]], questions: Optional[Sequence] = None,
                 question: Optional[str] = None, method: Union[Method, str, None] = None, max_new_tokens: int = 50,
                 mode: str = "multi_request", min_new_tokens: int = 0,
                 stop_token_ids: Optional[Sequence[int]] = None) -> Union[dict, list[dict]]:
        """context: a string (-> one dict) or a list of them (-> one dict per context, answered as a batch);
        questions: a list of questions (per context, a list of lists) or `question`: one; method: a Method, a spec
        ("snapkv:budget=256") or None (fullkv)."""
        if isinstance(context, (bytes, bytearray)):   # list(b"...") is one int per byte: never contexts
            raise ValueError(f"context is bytes ({bytes(context)!r:.40}), not text: decode it first "
                             f"(context.decode('utf-8'))")
        if not isinstance(context, (str, list, tuple)):
            raise ValueError(f"context must be a string or a list of strings, got {context!r:.60}")
        batch = not isinstance(context, str)
        contexts = list(context) if batch else [context]
        if question is not None:
            if questions is not None:
                raise ValueError("give questions=[...] or question=..., not both")
            questions = [question]
        if questions is None:
            raise ValueError("no questions: give questions=[...] (or question=...)")
        if isinstance(questions, (str, bytes)):   # one string is not a list of questions, one per character
            raise ValueError(f"questions is one string ({questions!r:.40}), not a list of questions: pass "
                             f"questions=[text] or question=text")
        per_context = list(questions) if batch else [questions]
        if batch and (len(per_context) != len(contexts) or any(isinstance(q, str) for q in per_context)):
            raise ValueError(f"{len(contexts)} contexts need one list of questions each, got {questions!r:.60}")
        inputs = {"contexts": contexts, "questions": per_context}
        answers = self._forward(self.preprocess(inputs, mode=check_mode(mode)),
                                method=method, max_new_tokens=max_new_tokens, mode=mode,
                                min_new_tokens=min_new_tokens, stop_token_ids=stop_token_ids)
        out = self.postprocess(answers)
        return out if batch else out[0]

    def preprocess(self, inputs: dict, mode: str = "multi_request") -> dict:
        """Texts -> what is fed: {"contexts", "questions", "followups" (multi_turn)}, framed by the chat template."""
        contexts, questions = inputs["contexts"], inputs["questions"]
        for i, qs in enumerate(questions):
            if isinstance(qs, str) or not qs:
                raise ValueError(f"context {i} has no questions: give a list of at least one question")
            for k, q in enumerate(qs):
                if not isinstance(q, str) or not q.strip():
                    raise ValueError(f"question {k} of context {i} is empty or not text: {q!r:.40}")
        for i, c in enumerate(contexts):
            if not isinstance(c, str) or not c.strip():
                raise ValueError(f"context {i} is empty or not text: {c!r:.40}")
        if not self.chat_template:
            return {"contexts": contexts, "questions": questions,
                    "followups": [["\n" + q for q in qs] for qs in questions] if mode == "multi_turn" else None}
        head, tail = chat_frame(self.tokenizer)
        framed = {"contexts": [head + c for c in contexts], "questions": [[q + tail for q in qs] for qs in questions],
                  "followups": None}
        if mode == "multi_turn":
            between, after = followup_frame(self.tokenizer)
            framed["followups"] = [[between + q + after for q in qs] for qs in questions]
        return framed

    def _forward(self, model_inputs: dict, method=None, max_new_tokens: int = 50, mode: str = "multi_request",
                 min_new_tokens: int = 0, stop_token_ids=None) -> list[list[Answer]]:
        if method is None:
            method = make_method("fullkv")
        elif isinstance(method, str):
            method = parse_method_spec(method)
        elif not isinstance(method, Method):
            raise ValueError(f"method must be a pyramidkv Method, a spec such as 'snapkv:budget=256', or None "
                             f"(fullkv); got {method!r:.60}")
        return answer_questions(self.model, self.tokenizer, model_inputs["contexts"], model_inputs["questions"],
                                method, max_new_tokens, mode=mode, followups=model_inputs["followups"],
                                stop_token_ids=stop_token_ids, min_new_tokens=min_new_tokens)

    def postprocess(self, answers: list[list[Answer]]) -> list[dict]:
        return [{"answers": [a.text for a in per], "stats": [_stats(a) for a in per]} for per in answers]


def _stats(answer: Answer) -> dict:
    """An answer's statistics (generation/shared.py `Answer`): everything but its text, None fields left out."""
    return {k: v for k, v in vars(answer).items() if k != "text" and v is not None}


def pipeline(model, tokenizer, chat_template: bool = True, device=None) -> KVCompressionPipeline:
    """The pipeline over a loaded model (pyramidkv.load_model()) and its tokenizer; device: None, where the model
    is (a model placed by a device map stays where accelerate put it)."""
    if device is None and getattr(model, "hf_device_map", None) is None:
        device = model.device
    return KVCompressionPipeline(model=model, tokenizer=tokenizer, chat_template=chat_template, device=device)


def register() -> None:
    """Make `transformers.pipeline("kv-compression", model=..., tokenizer=...)` build this pipeline."""
    from transformers import AutoModelForCausalLM
    from transformers.pipelines import PIPELINE_REGISTRY

    if TASK not in PIPELINE_REGISTRY.get_supported_tasks():
        PIPELINE_REGISTRY.register_pipeline(TASK, pipeline_class=KVCompressionPipeline, pt_model=AutoModelForCausalLM)
