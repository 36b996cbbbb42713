"""Models built from parallel3d's layers: the GPT family (GPT-2 and LLaMA)."""
from .config import TransformerConfig, gpt2_config, llama_config, llama_ffn_hidden_size
from .gpt import GPTModel, gather_logits

__all__ = ["TransformerConfig", "gpt2_config", "llama_config", "llama_ffn_hidden_size", "GPTModel", "gather_logits"]
