"""Build tiny Wan components in code, deterministically and offline.

Every component is a real diffusers / transformers class (the same classes a Wan2.1
checkpoint loads into), so a tiny model runs exactly the runtime code path of the real
ones. Weights come from a fixed seed (the VAE of `TRAINED_ARCH` is closed-form); no hub
access. Tests build small random models from here; `train.py` starts the shipped
`tiny-wan` (runtime/models/tiny/weights) from `TRAINED_ARCH`.

Besides Wan2.1 text-to-video (the default), `TinyWanConfig` can describe the other Wan
families diffusers runs, each as its diffusers checkpoint is laid out:

- Wan2.1 I2V: `image="clip"` (a CLIP vision image encoder, image cross-attention);
- Wan2.2 T2V A14B: `experts=2, boundary_ratio=...` (a second transformer, `transformer_2`);
- Wan2.2 I2V A14B: `image="latent", experts=2, boundary_ratio=...` (condition latents only);
- Wan2.2 TI2V-5B: `vae22=True, expand_timesteps=True` (the Wan2.2 VAE, per-token timesteps);
  text-to-video through `WanPipeline`, image-to-video through `WanImageToVideoPipeline`.

`pipeline_class(cfg)` and `pipeline_kwargs(cfg)` say how to assemble the pipeline:
`pipeline_class(cfg)(**build_tiny_wan(cfg), **pipeline_kwargs(cfg))`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanPipeline, WanTransformer3DModel
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast, UMT5Config, UMT5EncoderModel

# The image-to-video classes are imported where used: importing CLIPImageProcessor (also through
# diffusers' WanImageToVideoPipeline) warns on every import when torchvision is not installed.

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
    # The other Wan families (see the module docstring); the defaults are Wan2.1 text-to-video and
    # build the same weights as before these fields existed.
    # 2: a second transformer `transformer_2` (same architecture, seed + 5) for the low-noise steps,
    # as Wan2.2 A14B. diffusers uses it only when the pipeline has a boundary_ratio.
    experts: int = 1
    # Timesteps t >= boundary_ratio * 1000 go to `transformer`, the rest to `transformer_2`.
    boundary_ratio: float | None = None
    # Wan2.2 TI2V-5B: one timestep per token (the first latent frame of image-to-video is at t=0).
    expand_timesteps: bool = False
    # "none": text-to-video. "clip": Wan2.1 I2V, a CLIP vision image encoder and image
    # cross-attention. "latent": Wan2.2 I2V A14B, no image encoder. Both take the condition
    # latents and mask channels with the noise: in_channels = 2 * z_dim + 4.
    image: str = "none"
    # The Wan2.2 VAE (TI2V-5B): residual blocks, 2x2 pixel patches (12 channels), 16x spatially.
    vae22: bool = False
    # The tiny CLIP vision encoder of image="clip".
    clip_dim: int = 32
    clip_layers: int = 2
    clip_heads: int = 2
    clip_image_size: int = 32
    clip_patch: int = 8

    def __post_init__(self) -> None:
        if self.vae not in ("random", "pooling"):
            raise ValueError(f"vae must be 'random' or 'pooling', got {self.vae!r}")
        if self.vae == "pooling" and self.z_dim != 12:
            raise ValueError(f"the pooling VAE has 12 latent channels; got z_dim={self.z_dim}")
        if self.experts not in (1, 2):
            raise ValueError(f"experts must be 1 or 2, got {self.experts}")
        if self.boundary_ratio is not None:
            if self.experts != 2:
                raise ValueError("boundary_ratio needs experts=2 (diffusers runs transformer_2 below it)")
            if not 0.0 < self.boundary_ratio < 1.0:
                raise ValueError(f"boundary_ratio must be in (0, 1), got {self.boundary_ratio}")
        if self.image not in IMAGE_MODES:
            raise ValueError(f"image must be one of {IMAGE_MODES}, got {self.image!r}")
        if self.vae22 and self.vae != "random":
            raise ValueError("vae22 is a seeded Wan2.2 AutoencoderKLWan; it needs vae='random'")
        if self.expand_timesteps:
            if self.image != "none":
                # TI2V puts the image latents into the first latent frame; its transformer takes z_dim
                # channels, and WanImageToVideoPipeline concatenates nothing when expand_timesteps is set.
                raise ValueError(
                    "expand_timesteps (Wan2.2 TI2V) conditions on the image in-frame; image must be 'none'"
                )
            if tuple(self.patch_size) != (1, 2, 2):
                # diffusers builds the per-token timesteps as mask[0][0][:, ::2, ::2]
                raise ValueError(
                    f"expand_timesteps needs patch_size (1, 2, 2) as diffusers assumes; got {self.patch_size}"
                )

    @property
    def transformer_in_channels(self) -> int:
        """Noise latents, plus (I2V) the mask channels and the condition latents."""
        if self.image == "none":
            return self.z_dim
        return 2 * self.z_dim + VAE_TEMPORAL_STRIDE


# image= values of TinyWanConfig
IMAGE_MODES = ("none", "clip", "latent")
# Video frames per latent frame of every Wan VAE; WanImageToVideoPipeline's mask has this many channels.
VAE_TEMPORAL_STRIDE = 4


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
    """Return the pipeline components {tokenizer, text_encoder, transformer, vae, scheduler}, plus
    `transformer_2` (experts=2) and `image_encoder`, `image_processor` (image="clip")."""
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
    transformer = _build_transformer(cfg)
    latents_mean = [cfg.latents_stats[0] + cfg.latents_stats[2] * c for c in range(cfg.z_dim)]
    latents_std = [cfg.latents_stats[1] + cfg.latents_stats[2] * c for c in range(cfg.z_dim)]
    if cfg.vae == "pooling":
        from tiny_wan.vae import build_vae

        vae = build_vae(latents_mean, latents_std)
    elif cfg.vae22:
        torch.manual_seed(cfg.seed + 2)
        # Wan2.2's VAE as diffusers' convert_wan_to_diffusers.py configures it (base_dim 160,
        # decoder_base_dim 256, z_dim 48, dim_mult [1, 2, 4, 4], 2 res blocks), scaled down: RGB is
        # patchified 2x2 into 12 channels before the encoder, so pixels are 16x the latents.
        vae = AutoencoderKLWan(
            base_dim=cfg.vae_base_dim,
            decoder_base_dim=2 * cfg.vae_base_dim,
            z_dim=cfg.z_dim,
            dim_mult=[1, 2, 2, 2],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=latents_mean,
            latents_std=latents_std,
            is_residual=True,
            in_channels=12,
            out_channels=12,
            patch_size=2,
            scale_factor_temporal=VAE_TEMPORAL_STRIDE,
            scale_factor_spatial=16,
        )
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
    extra: dict = {}
    if cfg.image == "clip":
        from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

        torch.manual_seed(cfg.seed + 3)
        extra["image_encoder"] = CLIPVisionModel(
            CLIPVisionConfig(
                hidden_size=cfg.clip_dim,
                intermediate_size=2 * cfg.clip_dim,
                projection_dim=cfg.clip_dim,
                num_hidden_layers=cfg.clip_layers,
                num_attention_heads=cfg.clip_heads,
                image_size=cfg.clip_image_size,
                patch_size=cfg.clip_patch,
                hidden_act="gelu",  # as Wan2.1 I2V's ViT-H/14 (open_clip)
            )
        )
        extra["image_processor"] = CLIPImageProcessor(
            size={"shortest_edge": cfg.clip_image_size},
            crop_size={"height": cfg.clip_image_size, "width": cfg.clip_image_size},
        )
    if cfg.experts == 2:
        torch.manual_seed(cfg.seed + 5)
        extra["transformer_2"] = _build_transformer(cfg)
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction",
        use_flow_sigmas=True,
        num_train_timesteps=1000,
        flow_shift=cfg.flow_shift,
    )
    components = {
        "tokenizer": tokenizer,
        "text_encoder": text_encoder,
        "transformer": transformer,
        "vae": vae,
        "scheduler": scheduler,
        **extra,
    }
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return components


def _build_transformer(cfg: TinyWanConfig) -> WanTransformer3DModel:
    """One Wan transformer of `cfg` from the current torch seed (both experts share this)."""
    image: dict = {}
    if cfg.image == "clip":
        # Wan2.1 I2V: CLIP's penultimate hidden states, projected to the inner dim, get their own
        # key/value projections in every cross-attention (Wan-I2V-14B: image_dim 1280, added 5120).
        # Passed only here so other configs' config.json stays as it was.
        image = {"image_dim": cfg.clip_dim, "added_kv_proj_dim": cfg.heads * cfg.head_dim}
    return WanTransformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.heads,
        attention_head_dim=cfg.head_dim,
        in_channels=cfg.transformer_in_channels,
        out_channels=cfg.z_dim,
        text_dim=cfg.text_dim,
        freq_dim=64,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=256,
        **image,
    )


def pipeline_class(cfg: TinyWanConfig = TINY_WAN) -> type:
    """The diffusers pipeline of the family: WanImageToVideoPipeline for image != "none", else
    WanPipeline. (A TI2V model, image="none" with expand_timesteps, also runs image-to-video
    through WanImageToVideoPipeline over the same components.)"""
    if cfg.image == "none":
        return WanPipeline
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline


def pipeline_kwargs(cfg: TinyWanConfig = TINY_WAN) -> dict:
    """The pipeline constructor's own arguments (they go into model_index.json)."""
    return {"boundary_ratio": cfg.boundary_ratio, "expand_timesteps": cfg.expand_timesteps}
