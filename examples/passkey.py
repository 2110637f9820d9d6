"""The pass-key prompt the examples share: a key hidden in filler text, answer prefix prefilled."""

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there. ")


def passkey_prompt(key: int, num_fillers: int = 12, depth: float = 0.5) -> str:
    """SmolLM2 chat-template text (~25 tokens per filler: 12 fillers ~ 360 tokens); the needle sits at
    `depth` (0 = start, 1 = end) and the assistant turn starts with "The pass key is "."""
    parts = [FILLER] * num_fillers
    parts.insert(int(num_fillers * depth), f"The pass key is {key}. Remember it. {key} is the pass key. ")
    doc = INTRO + "".join(parts)
    return (f"<|im_start|>user\n{doc}\nWhat is the pass key?<|im_end|>\n"
            f"<|im_start|>assistant\nThe pass key is ")
