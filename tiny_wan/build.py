"""Build tiny Wan components in code, deterministically and offline.

Every component is a real diffusers / transformers class (the same classes a Wan2.1
checkpoint loads into), so a tiny model runs exactly the runtime code path of the real
ones. Weights come from a fixed seed (the VAE of `TRAINED_ARCH` is closed-form); no hub
access. Tests build small random models from here; `train.py` starts the shipped
`tiny-wan` (runtime/models/tiny/weights) from `TRAINED_ARCH`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    patch_size: tuple[int, int, int] = (1, 2, 2)
    # "random": a seeded AutoencoderKLWan of z_dim channels; "pooling": the closed-form VAE of
    # vae.py (12 channels: exact 4x4 pooling, four frames per latent frame).
    vae: str = "random"

    def __post_init__(self) -> None:
        if self.vae not in ("random", "pooling"):
            raise ValueError(f"vae must be 'random' or 'pooling', got {self.vae!r}")
        if self.vae == "pooling" and self.z_dim != 12:
            raise ValueError(f"the pooling VAE has 12 latent channels; got z_dim={self.z_dim}")


TINY_WAN = TinyWanConfig()

# The architecture of the shipped, trained `tiny-wan` (runtime/models/tiny/weights): at its
# default 64x64x17 a video is 5 x 8 x 8 = 320 transformer tokens (2x2 latent patches, as Wan's);
# 4 heads allow Ulysses 2/4.
TRAINED_ARCH = TinyWanConfig(
    heads=4,
    head_dim=48,
    layers=4,
    ffn_dim=768,
    z_dim=12,
    patch_size=(1, 2, 2),
    vae="pooling",
    latents_stats=(-0.45, 0.55, 0.0),
)


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
        patch_size=cfg.patch_size,
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
    latents_mean = [cfg.latents_stats[0] + cfg.latents_stats[2] * c for c in range(cfg.z_dim)]
    latents_std = [cfg.latents_stats[1] + cfg.latents_stats[2] * c for c in range(cfg.z_dim)]
    if cfg.vae == "pooling":
        from tiny_wan.vae import build_vae

        vae = build_vae(latents_mean, latents_std)
    else:
        torch.manual_seed(cfg.seed + 2)
        vae = AutoencoderKLWan(
            base_dim=cfg.vae_base_dim,
            z_dim=cfg.z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=latents_mean,
            latents_std=latents_std,
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
