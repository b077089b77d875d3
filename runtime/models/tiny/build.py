"""Build the `tiny-wan` components in code, deterministically and offline.

Every component is a real diffusers / transformers class (the same classes a Wan2.1
checkpoint loads into), so the tiny model runs exactly the runtime code path of the
real ones. Weights come from a fixed seed; no hub access.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

# Words of the procedural captions ("a red circle moving left on a black background")
# plus a few common ones; anything else maps to <unk>.
VOCAB_WORDS: tuple[str, ...] = (
    "a", "an", "the", "on", "in", "of", "and", "with", "to", "is", "moving", "moves",
    "background", "video", "shape", "object",
    "circle", "square", "triangle", "ball", "box",
    "red", "green", "blue", "yellow", "white", "black", "gray", "grey", "orange", "purple",
    "left", "right", "up", "down", "slowly", "quickly", "fast", "slow",
    ",", ".", "!", "?",
)  # fmt: skip


@dataclass(frozen=True)
class TinyWanConfig:
    """Sizes of the tiny model. Changing any number changes the weights."""

    seed: int = 0
    heads: int = 4
    head_dim: int = 16
    layers: int = 4
    ffn_dim: int = 128
    text_dim: int = 32
    text_layers: int = 2
    text_heads: int = 4
    max_text_len: int = 32
    vae_base_dim: int = 8
    z_dim: int = 16
    flow_shift: float = 3.0
    # VAE latent statistics (mean, std) of channel 0, growing per channel; identity by default.
    latents_stats: tuple[float, float, float] = (0.0, 1.0, 0.0)  # (mean, std, step per channel)
    vocab: tuple[str, ...] = field(default=VOCAB_WORDS)


TINY_WAN = TinyWanConfig()


def build_tokenizer(words: tuple[str, ...] = VOCAB_WORDS) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with T5's special ids (<pad>=0, </s>=1, <unk>=2)."""
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")


def build_tiny_wan(cfg: TinyWanConfig = TINY_WAN) -> dict:
    """Return the pipeline components {tokenizer, text_encoder, transformer, vae, scheduler}."""
    tokenizer = build_tokenizer(cfg.vocab)
    # One generator state per component so adding a component never changes another's weights.
    torch.manual_seed(cfg.seed)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer),
            d_model=cfg.text_dim,
            d_kv=cfg.text_dim // cfg.text_heads,
            d_ff=cfg.text_dim * 2,
            num_layers=cfg.text_layers,
            num_heads=cfg.text_heads,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=cfg.max_text_len,
            pad_token_id=0,
            eos_token_id=1,
        )
    )
    torch.manual_seed(cfg.seed + 1)
    transformer = WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=cfg.heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.z_dim,
        out_channels=cfg.z_dim,
        text_dim=cfg.text_dim,
        freq_dim=64,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=256,
    )
    torch.manual_seed(cfg.seed + 2)
    vae = AutoencoderKLWan(
        base_dim=cfg.vae_base_dim,
        z_dim=cfg.z_dim,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[cfg.latents_stats[0] + cfg.latents_stats[2] * c for c in range(cfg.z_dim)],
        latents_std=[cfg.latents_stats[1] + cfg.latents_stats[2] * c for c in range(cfg.z_dim)],
    )
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=cfg.flow_shift,
    )
    for module in (text_encoder, transformer, vae):
        module.eval().requires_grad_(False)
    return {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "transformer": transformer,
        "vae": vae,
        "scheduler": scheduler,
    }


def cache_root() -> Path:
    return Path(os.environ.get("DITANGO_CACHE_DIR") or Path.home() / ".cache" / "ditango")


def materialize(cfg: TinyWanConfig = TINY_WAN, root: Path | None = None) -> Path:
    """Write the built model once as a diffusers-format directory and return its path.

    The built-in model then loads through exactly the code path of a user checkpoint
    (`WanPipeline.from_pretrained`, safetensors, per-library float32 rules for bf16/fp16).
    The key covers the config and the library versions that decide the seeded weights.
    Concurrent processes (ranks, parallel runs) serialise on a lock file; the directory is
    written under a temporary name, validated, then renamed into place.
    """
    import diffusers
    from diffusers import WanPipeline

    from runtime.errors import ModelDirError
    from runtime.models.checkpoint import inspect_model_dir

    key = hashlib.sha256(repr((cfg, torch.__version__, diffusers.__version__)).encode()).hexdigest()[:12]
    path = (root or cache_root()) / "models" / f"tiny-wan-{key}"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            try:
                inspect_model_dir(path)
                return path
            except ModelDirError:  # a damaged cache entry: rebuild it
                shutil.rmtree(path)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
        try:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                # transformers' save_pretrained silently writes nothing on ranks != 0 of an
                # initialized process group: build in a clean interpreter instead.
                if cfg != TINY_WAN:
                    raise RuntimeError("only the default tiny-wan config can be built inside a process group")
                subprocess.run([sys.executable, "-m", "runtime.models.tiny.build", str(tmp)], check=True)
            else:
                WanPipeline(**build_tiny_wan(cfg)).save_pretrained(tmp, safe_serialization=True)
            inspect_model_dir(tmp)
            os.rename(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


if __name__ == "__main__":  # python -m runtime.models.tiny.build DIR: write the default model to DIR
    from diffusers import WanPipeline

    WanPipeline(**build_tiny_wan()).save_pretrained(sys.argv[1], safe_serialization=True)
