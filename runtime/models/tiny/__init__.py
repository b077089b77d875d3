"""The built-in `tiny-wan` model: real diffusers Wan classes in a tiny configuration."""

from runtime.models.tiny.build import TINY_WAN, TinyWanConfig, build_tiny_wan, build_tokenizer, materialize

__all__ = ["TINY_WAN", "TinyWanConfig", "build_tiny_wan", "build_tokenizer", "materialize"]
