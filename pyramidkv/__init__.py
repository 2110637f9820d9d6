"""pyramidkv: KV-cache compression for long-context LLMs, one shared core for every method."""

from pyramidkv.core.cache import CompressedCache
from pyramidkv.core.kept import KeptKV
from pyramidkv.generation.cache_file import load_cache, save_cache
from pyramidkv.generation.pipeline import KVCompressionPipeline, pipeline, register as _register_pipeline
from pyramidkv.methods import METHODS, Method, make_method, method_options
from pyramidkv.models.default_model import DEFAULT_MODEL_NAME, default_model_path
from pyramidkv.models.loading import load_model
from pyramidkv.models.patch import CompressionPatch, compress

__all__ = [
    "CompressedCache", "CompressionPatch", "DEFAULT_MODEL_NAME", "KeptKV", "METHODS", "Method",
    "KVCompressionPipeline", "compress", "default_model_path", "load_cache", "load_model", "make_method",
    "method_options", "pipeline", "save_cache",
]

_register_pipeline()   # transformers.pipeline("kv-compression", model=..., tokenizer=...)
