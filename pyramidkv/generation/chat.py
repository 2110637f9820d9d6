"""The chat template's frame around a user message, found by rendering it around a placeholder and splitting
there, so that a prompt can be built (and its length counted) as frame + body + frame.

`chat_frame(tokenizer, system)`: the text before and after a lone user message, the assistant turn opened.
`system`:
  * TEMPLATE_DEFAULT: whatever the template renders for a lone user turn (with SmolLM2 that includes its
    default system prompt; LongBench, the needle runner and the pipeline use this, as their reference harnesses
    do);
  * None: no system turn, even where the template would add a default one (RULER: its model templates
    have none); the default turn is found with a probe system message and cut off, a leading BOS kept;
  * a string: that system turn.

`followup_frame(tokenizer)`: the text of a later user turn of a conversation, after the previous assistant
reply's end-of-turn token: what the shared-context protocol's multi_turn feeds around a follow-up question.
"""

from __future__ import annotations

from pyramidkv.generation.greedy import end_of_turn_token

TEMPLATE_DEFAULT = object()
_PLACEHOLDER = "\u2063PYRAMIDKV-USER-MESSAGE\u2063"
_PROBE = "PYRAMIDKV-SYSTEM-PROBE"


def chat_frame(tokenizer, system=TEMPLATE_DEFAULT) -> tuple[str, str]:
    """(text before the user message, text after it, assistant turn opened) of the tokenizer's chat template.
    ValueError when the template does not show the message verbatim or refuses a system turn."""
    def render(messages, add_generation_prompt=True):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    user = {"role": "user", "content": _PLACEHOLDER}
    if isinstance(system, str):
        try:
            text = render([{"role": "system", "content": system}, user])
        except Exception as e:  # jinja raises its own errors for roles a template refuses
            raise ValueError(f"the chat template of {type(tokenizer).__name__} takes no system turn ({e}); leave "
                             f"out the system prompt") from None
    else:
        text = render([user])
        if system is None:
            try:
                with_probe = render([{"role": "system", "content": _PROBE}, user])
                probe_turn = render([{"role": "system", "content": _PROBE}], False)
            except Exception:  # a template that refuses system turns adds none either
                with_probe = probe_turn = ""
            if probe_turn and _PROBE in probe_turn and with_probe.startswith(probe_turn):
                bos = tokenizer.bos_token or ""
                text = (bos if bos and probe_turn.startswith(bos) else "") + with_probe[len(probe_turn):]
    if text.count(_PLACEHOLDER) != 1:
        raise ValueError(f"the chat template of {type(tokenizer).__name__} does not show the user message verbatim "
                         f"once; use a plain prompt (no chat template)")
    before, after = text.split(_PLACEHOLDER)
    return before, after


_REPLY = "\u2063PYRAMIDKV-ASSISTANT-REPLY\u2063"
_LATER = "\u2063PYRAMIDKV-LATER-MESSAGE\u2063"


def followup_frame(tokenizer) -> tuple[str, str]:
    """(text after an assistant reply's end-of-turn token up to the next user message, text after that message,
    assistant turn opened) of the tokenizer's chat template, e.g. SmolLM2: ("\\n<|im_start|>user\\n",
    "<|im_end|>\\n<|im_start|>assistant\\n"). The end-of-turn token is the one the template writes after a reply
    (`end_of_turn_token`), else the EOS token; it must follow the reply verbatim. ValueError when the template
    does not show the conversation that way."""
    name = type(tokenizer).__name__
    messages = [{"role": "user", "content": _PLACEHOLDER}, {"role": "assistant", "content": _REPLY},
                {"role": "user", "content": _LATER}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # jinja raises its own errors for conversations a template refuses
        raise ValueError(f"the chat template of {name} does not render a second user turn ({e}); use a plain "
                         f"prompt (no chat template)") from None
    if any(text.count(mark) != 1 for mark in (_PLACEHOLDER, _REPLY, _LATER)) or \
            not text.index(_PLACEHOLDER) < text.index(_REPLY) < text.index(_LATER):
        raise ValueError(f"the chat template of {name} does not show a conversation's messages verbatim once, in "
                         f"order; use a plain prompt (no chat template)")
    between, after = text.split(_REPLY)[1].split(_LATER)
    turn_end = end_of_turn_token(tokenizer)
    eot = turn_end or tokenizer.eos_token
    if not eot or not between.startswith(eot):
        what = f"its end-of-turn token {eot!r}" if turn_end else f"the EOS token {eot!r}"
        raise ValueError(f"the chat template of {name} does not end an assistant reply with {what}; use a plain "
                         f"prompt (no chat template)")
    return between[len(eot):], after
