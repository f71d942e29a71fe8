"""Model runtime: configs, weight loading, our decoder forward, the static KV cache."""

from .config import ModelConfig
from .kv_cache import KVCache
from .llama import LlamaDecoder, causal_mask
from .loading import DEFAULT_MODEL, KNOWN_MODELS, LoadedModel, list_models, load_hf_dir, read_checkpoint

__all__ = ["ModelConfig", "KVCache", "LlamaDecoder", "causal_mask", "DEFAULT_MODEL", "KNOWN_MODELS",
           "LoadedModel", "list_models", "load_hf_dir", "read_checkpoint"]
