"""Load a model + tokenizer by name: the embedded default, a local HF directory, or a hub id."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import re
from pathlib import Path
from typing import Optional, Union

import torch

from pyramidkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pyramidkv.models.line import INTERFACE_LINE, PINNED, line_name
from pyramidkv.models.patch import ATTENTION_IMPLEMENTATIONS, MODEL_GLUE, check_family_implementation
from pyramidkv.models.tf5.attention import BASES
from pyramidkv.models.tf5.families import FAMILIES, family

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# accelerate's placement strategies, as from_pretrained(device_map=...) takes them by name
DEVICE_MAP_STRATEGIES = ("auto", "balanced", "balanced_low_0", "sequential")
DeviceMap = Union[str, dict]


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
                dtype: Optional[str] = None, model_class: Optional[str] = None,
                device_map: Optional[DeviceMap] = None):
    """Everything load_model checks, without loading weights: (resolved path, config, device, dtype); with a
    device_map, device is the kind it runs on ("cuda" when it names a GPU or places by a strategy on a machine
    with one, else "cpu").

    Raises ValueError / ImportError / FileNotFoundError / OSError with a one-line message.
    """
    from transformers import AutoConfig

    if device_map is not None:
        device_map = resolve_device_map(device_map)
        if device != "auto":
            raise ValueError(f"device={device!r} and a device_map: the device map places every module; "
                             f"leave device at 'auto'")
        device = device_map_kind(device_map)
    else:
        device = resolve_device(device)
    check_attn_implementation(attn_implementation, device)
    dtype = resolve_dtype(dtype, device)
    path = resolve_model_path(model_path)
    check_line_has_family(path, model_path)
    config = AutoConfig.from_pretrained(path)
    if model_class is not None:
        config = config_as(config, model_class)
    if INTERFACE_LINE:   # the 5.x line: the family's row and the implementations the interface extends
        family(config.model_type)
        if attn_implementation not in BASES:
            raise ValueError(f"attn_implementation {attn_implementation!r} is not supported on the 5.x line; use "
                             f"{', '.join(BASES)} (or the pinned line: requirements.txt)")
    elif config.model_type not in MODEL_GLUE:
        raise ValueError(f"unsupported model type {config.model_type!r} ({model_path}); "
                         f"supported: {', '.join(MODEL_GLUE)}")
    else:
        check_family_implementation(config.model_type, attn_implementation)
    if isinstance(device_map, dict):
        check_device_map_modules(device_map, config)
    return path, config, device, dtype


def check_line_has_family(path: str, model_path: str) -> None:
    """A local checkpoint of a family this line has no row for (read from its config.json, before transformers
    parses it: 4.44.2 cannot parse a Qwen3 or Gemma3 config) is refused in one line naming the line that has it,
    or saying that neither has it."""
    config_file = Path(path) / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    here, there = (FAMILIES, MODEL_GLUE) if INTERFACE_LINE else (MODEL_GLUE, FAMILIES)
    if model_type is None or model_type in here:
        return
    other = (f"the pinned line (transformers {PINNED}: requirements.txt, make setup)" if INTERFACE_LINE else
             "the 5.x line (requirements-tf5.txt, make setup-tf5)")
    if model_type in there:
        raise ValueError(f"model type {model_type!r} ({model_path}) runs on {other}, not under {line_name()}")
    raise ValueError(f"unsupported model type {model_type!r} ({model_path}): neither transformers line supports it "
                     f"({line_name()}: {', '.join(here)}; {other}: {', '.join(there)})")


def resolve_device_map(device_map: DeviceMap) -> DeviceMap:
    """A device map as load_model takes it -> a strategy name or {module name: "cpu" | "cuda:N"}.

    device_map: a strategy (auto, balanced, balanced_low_0, sequential: accelerate places the layers, filling
    the GPUs first, then CPU memory), a JSON object (text starting with "{") or the path of a JSON file holding
    one, or a dict; an object maps module names ("model.embed_tokens", "model.layers.0", "lm_head", "" for the
    whole model) to devices: "cpu", "cuda", "cuda:N" or a GPU index N.
    """
    given = device_map
    if isinstance(device_map, str) and device_map not in DEVICE_MAP_STRATEGIES:
        text = device_map
        if not device_map.lstrip().startswith("{"):
            path = Path(device_map).expanduser()
            if not path.is_file():
                raise ValueError(f"device_map {given!r} is neither a strategy ({', '.join(DEVICE_MAP_STRATEGIES)}) "
                                 f"nor a JSON file or object mapping module names to devices")
            text = path.read_text()
        try:
            device_map = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"device_map {given!r}: not valid JSON ({e})") from None
    if isinstance(device_map, str):
        return device_map
    if not isinstance(device_map, dict) or not device_map:
        raise ValueError(f"device_map {given!r}: give a strategy ({', '.join(DEVICE_MAP_STRATEGIES)}) or a "
                         f"non-empty mapping of module names to devices")
    return {str(name): _map_device(name, device) for name, device in device_map.items()}


def _map_device(name: str, device) -> str:
    """One device of a device map as a torch device string, checked against the machine."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    if not isinstance(device, str) or not (device == "cpu" or device == "cuda" or
                                           (device.startswith("cuda:") and device[5:].isdigit())):
        raise ValueError(f"device_map[{name!r}] = {device!r}: a device is cpu, cuda, cuda:N or a GPU index N "
                         f"(disk offloading is not supported)")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device_map[{name!r}] = {device!r} but CUDA is not available; map it to cpu")
        index = int(device[5:] or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(f"device_map[{name!r}] = {device!r} but this machine has {torch.cuda.device_count()} "
                             f"GPU(s)")
        device = f"cuda:{index}"
    return device


def device_map_kind(device_map: DeviceMap) -> str:
    """"cuda" when the (resolved) map computes on a GPU, else "cpu"."""
    if isinstance(device_map, str):
        return "cuda" if torch.cuda.is_available() else "cpu"
    return "cuda" if any(d.startswith("cuda") for d in device_map.values()) else "cpu"


def check_device_map_modules(device_map: dict, config) -> None:
    """Every name of the map is a module of the model and every weight falls under one name (checked on the
    model built on the meta device: no memory, no weights read)."""
    from accelerate import init_empty_weights

    from transformers import AutoModelForCausalLM

    build = MODEL_GLUE[config.model_type].causal_lm if config.model_type in MODEL_GLUE else AutoModelForCausalLM.from_config
    with init_empty_weights():   # 5.x's Qwen3 and Gemma3 have no glue row: their auto class
        model = build(config)
    modules = dict(model.named_modules())
    unknown = [name for name in device_map if name not in modules]
    if unknown:
        raise ValueError(f"device_map names {unknown[0]!r}, which is no module of {type(model).__name__} "
                         f"(modules are named like model.embed_tokens, model.layers.0, model.norm, lm_head)")
    prefixes = tuple("" if name == "" else name + "." for name in device_map)
    missing = [name for name, _ in model.named_parameters() if not name.startswith(prefixes)]
    if missing:
        raise ValueError(f"device_map places no device for {len(missing)} weight(s), e.g. {missing[0]!r}: map "
                         f"every module (or \"\" for the rest)")


def load_model(
    model_path: str = DEFAULT_MODEL_NAME,
    attn_implementation: str = "sdpa",
    device: str = "auto",
    dtype: Optional[str] = None,
    model_class: Optional[str] = None,
    device_map: Optional[DeviceMap] = None,
):
    """Return (model, tokenizer), model in eval mode on `device`, tokenizer left-padding.

    dtype: float32|float16|bfloat16; default float32 on CPU, bfloat16 on CUDA (with a device map: on CUDA
        when it names a GPU).
    model_class: None (from the config), or a type in MODEL_GLUE (models/patch.py) to load the weights
        into that architecture (SmolLM2's weights load as Mistral too).
    device_map: None (the whole model on `device`), or the modules spread over devices by accelerate
        (from_pretrained's device_map; `resolve_device_map` says what it takes; `model.hf_device_map` then
        says where each module went). With a map, `device` must stay "auto". Each layer's cache lives on the
        device its layer computes on. Under accelerate's rule a module mapped to "cpu" in a map that also
        names a GPU is offloaded: its weights stay in CPU memory and it computes on the first GPU.
    """
    from transformers import AutoTokenizer

    path, config, device, dtype = check_model(model_path, attn_implementation, device, dtype, model_class,
                                              device_map)
    if INTERFACE_LINE:   # 5.x: the auto class (Gemma3's text checkpoints: Gemma3ForCausalLM); `dtype`, not torch_dtype
        from transformers import AutoModelForCausalLM

        model_class, dtype_argument = AutoModelForCausalLM, "dtype"
    else:
        model_class, dtype_argument = MODEL_GLUE[config.model_type].causal_lm, "torch_dtype"
    kwargs = {"config": config, dtype_argument: DTYPES[dtype], "attn_implementation": attn_implementation}
    if device_map is None:
        model = model_class.from_pretrained(path, **kwargs).to(device)
    else:
        model = model_class.from_pretrained(path, device_map=resolve_device_map(device_map), **kwargs)
    model.eval()
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
    has weights the checkpoint lacks, other than biases (transformers starts those at zero: Llama as Qwen2).
    The architectures are the glue rows (MODEL_GLUE) that the installed line runs: on the 5.x line llama,
    mistral, qwen2 and phi3 (its others, Qwen3 and Gemma3, have q/k norms no other layout has)."""
    here, there = (FAMILIES, MODEL_GLUE) if INTERFACE_LINE else (MODEL_GLUE, FAMILIES)
    choices = ", ".join(name for name in MODEL_GLUE if name in here)
    if model_class in here and model_class not in MODEL_GLUE:   # 5.x: Qwen3, Gemma3 (q/k norms), refused ones
        raise ValueError(f"model_class {model_class!r}: no other family's weights load as it (it has no glue "
                         f"row to re-express a config with); choose one of {choices}")
    if model_class in there and model_class not in here:
        other = f"the pinned line (transformers {PINNED})" if INTERFACE_LINE else "the 5.x line"
        raise ValueError(f"model_class {model_class!r} is a family of {other} only, not of {line_name()}; "
                         f"choose one of {choices}")
    if model_class not in MODEL_GLUE:
        raise ValueError(f"unknown model_class {model_class!r}; choose one of {choices}")
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
