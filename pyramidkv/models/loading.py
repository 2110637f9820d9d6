"""Load a model + tokenizer by name: the embedded default, a local HF directory, or a hub id."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
from pathlib import Path
from typing import Optional

import torch

from pyramidkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pyramidkv.models.patch import ATTENTION_IMPLEMENTATIONS, MODEL_GLUE, check_family_implementation

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_model_path(model_path: str) -> str:
    """`smollm2-135m` -> the converted embedded checkpoint; a local directory or a hub id as given."""
    if model_path in (DEFAULT_MODEL_NAME, "default"):
        return str(default_model_path())
    path = Path(model_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"model directory {path} has no config.json")
        return str(path)
    looks_like_hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise FileNotFoundError(f"model path {model_path!r} does not exist; give a local HF directory, a hub id "
                                f"(org/name) or {DEFAULT_MODEL_NAME!r} for the embedded default model")
    return model_path


def check_attn_implementation(attn_implementation: str, device: str) -> None:
    if attn_implementation not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"unknown attn_implementation {attn_implementation!r}; "
                         f"choose one of {', '.join(ATTENTION_IMPLEMENTATIONS)}")
    if attn_implementation == "flash_attention_2":
        if importlib.util.find_spec("flash_attn") is None:
            raise ImportError("attn_implementation='flash_attention_2' needs the optional package flash-attn "
                              "(CUDA only: pip install flash-attn --no-build-isolation); "
                              "use --attn_implementation sdpa (or eager) instead")
        if not str(device).startswith("cuda"):
            raise ValueError(f"flash_attention_2 runs on CUDA only, but device is {device!r}; use sdpa on CPU")


def resolve_device(device: str = "auto") -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available; use --device cpu")
    if device != "cpu" and not device.startswith("cuda"):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda[:N] or auto")
    return device


def resolve_dtype(dtype: Optional[str], device: str) -> str:
    """float32 on CPU, bfloat16 on CUDA unless given."""
    if dtype is None:
        dtype = "float32" if device == "cpu" else "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    return dtype


def check_model(model_path: str = DEFAULT_MODEL_NAME, attn_implementation: str = "sdpa", device: str = "auto",
                dtype: Optional[str] = None, model_class: Optional[str] = None):
    """Everything load_model checks, without loading weights: (resolved path, config, device, dtype).

    Raises ValueError / ImportError / FileNotFoundError / OSError with a one-line message.
    """
    from transformers import AutoConfig

    device = resolve_device(device)
    check_attn_implementation(attn_implementation, device)
    dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(model_path)
    config = AutoConfig.from_pretrained(path)
    if model_class is not None:
        config = config_as(config, model_class)
    if config.model_type not in MODEL_GLUE:
        raise ValueError(f"unsupported model type {config.model_type!r} ({model_path}); "
                         f"supported: {', '.join(MODEL_GLUE)}")
    check_family_implementation(config.model_type, attn_implementation)
    return path, config, device, dtype


def load_model(
    model_path: str = DEFAULT_MODEL_NAME,
    attn_implementation: str = "sdpa",
    device: str = "auto",
    dtype: Optional[str] = None,
    model_class: Optional[str] = None,
):
    """Return (model, tokenizer), model in eval mode on `device`, tokenizer left-padding.

    dtype: float32|float16|bfloat16; default float32 on CPU, bfloat16 on CUDA.
    model_class: None (from the config), or a type in MODEL_GLUE (models/patch.py) to load the weights
        into that architecture (SmolLM2's weights load as Mistral too).
    """
    from transformers import AutoTokenizer

    path, config, device, dtype = check_model(model_path, attn_implementation, device, dtype, model_class)
    model = MODEL_GLUE[config.model_type].causal_lm.from_pretrained(path, config=config, torch_dtype=DTYPES[dtype],
                                                                    attn_implementation=attn_implementation)
    model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def generation_config(path: str, config):
    """The generation config `load_model`'s model gets, without its weights: the folder's (or hub id's)
    generation_config.json, else one made from `config` (transformers' own fallback)."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return GenerationConfig.from_model_config(config)


def family_name(glue) -> str:
    """A family's display name, from its glue's causal-LM class: LlamaForCausalLM -> Llama."""
    name = glue.causal_lm.__name__
    return name[: -len("ForCausalLM")] if name.endswith("ForCausalLM") else name


def supported_models() -> str:
    """The supported families as --help lists them: `llama (LlamaForCausalLM), mistral (...)`."""
    return ", ".join(f"{model_type} ({glue.causal_lm.__name__})" for model_type, glue in MODEL_GLUE.items())


def config_as(config, model_class: str):
    """Re-express a config as another supported architecture with the same weights layout (its glue's
    `config_as`); refused with one line where the checkpoint's weights have no place in that architecture or it
    has weights the checkpoint lacks, other than biases (transformers starts those at zero: Llama as Qwen2)."""
    if model_class not in MODEL_GLUE:
        raise ValueError(f"unknown model_class {model_class!r}; choose one of {', '.join(MODEL_GLUE)}")
    if config.model_type == model_class:
        return config
    glue = MODEL_GLUE[model_class]
    new = glue.config_as(config)
    from transformers import AutoModelForCausalLM

    source = MODEL_GLUE[config.model_type].causal_lm if config.model_type in MODEL_GLUE else None
    given = parameter_names(source or AutoModelForCausalLM.from_config, config)
    wanted = parameter_names(glue.causal_lm, new)
    unplaced, missing = sorted(given - wanted), sorted(name for name in wanted - given if not name.endswith(".bias"))
    if unplaced or missing:
        lacks = f"{glue.causal_lm.__name__} has no {', '.join(unplaced)}" if unplaced else ""
        needs = f"{config.model_type} has no {', '.join(missing)}" if missing else ""
        raise ValueError(f"{config.model_type} weights do not load as {model_class}: "
                         f"{'; '.join(part for part in (lacks, needs) if part)}")
    return new


def parameter_names(build, config) -> set[str]:
    """The parameter names of the model `build(config)` makes, layers as `*` (one layer, built on the meta
    device: no memory, no weights)."""
    one_layer = copy.deepcopy(config)
    one_layer.num_hidden_layers = 1
    with torch.device("meta"):
        model = build(one_layer)
    return {re.sub(r"\.\d+\.", ".*.", name) for name, _ in model.named_parameters()}


os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
