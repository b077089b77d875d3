"""The built-in `tiny-wan` model: real diffusers Wan classes in a tiny configuration, trained
on procedural moving-shape videos (data.py, train.py), with a closed-form VAE (vae.py) and
a prompt-adherence checker (judge.py). How the model is made, not what the runtime needs:
the shipped weights live in `runtime/models/tiny/weights/` and load like any checkpoint."""

from tiny_wan.build import TINY_WAN, TRAINED_ARCH, TinyWanConfig, build_tiny_wan, build_tokenizer

__all__ = ["TINY_WAN", "TRAINED_ARCH", "TinyWanConfig", "build_tiny_wan", "build_tokenizer"]
