"""Small offline tokenizers of the chat families: each family's special tokens, its published chat template
(from the model's tokenizer_config.json; data, written here from the released files) and its
generation_config.json eos list where the released model has one. A WordLevel vocabulary: every other word is
<unk>, enough to render and tokenize prompts.

`family_tokenizer_dir(folder, family)` saves one as a PreTrainedTokenizerFast folder (plus generation_config.json);
FAMILIES[family]["stops"] are the reply's end tokens the released model stops at (the facts the tests check).
"""

from __future__ import annotations

import json
from pathlib import Path

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
    "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- else %}{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n' }}{%- endif %}{%- for message in messages %}{%- if (message.role == \"user\") or "
    "(message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}")
GEMMA2_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}")
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# specials: the tokenizer's special tokens; generation_eos: generation_config.json's eos_token_id (tokens; a
# str is an int there), None: the release has no generation_config.json; stops: what the release stops at.
FAMILIES = {
    "llama3": dict(  # Meta-Llama-3-8B-Instruct as released (tokenizer eos <|end_of_text|>)
        template=LLAMA3_TEMPLATE, bos="<|begin_of_text|>", eos="<|end_of_text|>", pad=None, unk="<unk>",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        generation_eos=["<|end_of_text|>", "<|eot_id|>"], stops={"<|end_of_text|>", "<|eot_id|>"}),
    "qwen2": dict(  # Qwen2.5-7B-Instruct
        template=QWEN25_TEMPLATE, bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk="<unk>",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        generation_eos=["<|im_end|>", "<|endoftext|>"], stops={"<|im_end|>", "<|endoftext|>"}),
    "gemma2": dict(  # gemma-2-9b-it as first released: its generation config lists <eos> only
        template=GEMMA2_TEMPLATE, bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        generation_eos="<eos>", stops={"<eos>", "<end_of_turn>"}),
    "phi3": dict(  # Phi-3-mini-4k-instruct
        template=PHI3_TEMPLATE, bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>",
        specials=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|end|>", "<|user|>", "<|system|>"],
        generation_eos=["<|endoftext|>", "<|assistant|>", "<|end|>"], stops={"<|endoftext|>", "<|assistant|>", "<|end|>"}),
    "mistral": dict(  # Mistral-7B-Instruct-v0.2
        template=MISTRAL_TEMPLATE, bos="<s>", eos="</s>", pad=None, unk="<unk>", specials=["<unk>", "<s>", "</s>"],
        generation_eos="</s>", stops={"</s>"}),
}
WORDS = ["the", "a", "is", "what", "pass", "key", "user", "assistant", "system", "model", "[INST]", "[/INST]", "?"]


def family_tokenizer_dir(folder: Path, family: str, *, chat_template: bool = True,
                         generation_config: bool = True) -> Path:
    """Save `family`'s tokenizer (and its generation_config.json unless told not to) in `folder`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    spec = FAMILIES[family]
    specials = list(dict.fromkeys([spec["unk"], *spec["specials"]]))
    vocab = {token: i for i, token in enumerate([*specials, *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token=spec["unk"]))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    named = {k: spec[k] for k in ("bos", "eos", "pad", "unk") if spec[k] is not None}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **{f"{k}_token": v for k, v in named.items()},
                                        chat_template=spec["template"] if chat_template else None,
                                        clean_up_tokenization_spaces=False)
    # special added tokens, not listed as additional_special_tokens (as Llama 3's <|eot_id|> is)
    tokenizer.add_tokens([t for t in specials if t not in named.values()], special_tokens=True)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(folder)
    if generation_config:
        eos = spec["generation_eos"]
        ids = vocab[eos] if isinstance(eos, str) else [vocab[t] for t in eos]
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": ids}), encoding="utf-8")
    return folder
