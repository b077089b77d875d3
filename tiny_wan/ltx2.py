"""Build a tiny random LTX-2 in code, deterministically and offline.

Every component is the class a diffusers-format LTX-2 checkpoint (Lightricks/LTX-2, i.e. LTX-2.0) loads
into, with the config flags of diffusers' scripts/convert_ltx2_to_diffusers.py for `--version 2.0`, only
narrower and shallower. So the tiny model runs the code path of the real one through diffusers'
`LTX2Pipeline` (text to video+audio) and `LTX2ImageToVideoPipeline`:

- `transformer`: `LTX2VideoTransformer3DModel`, the audio-video DiT. Each block has video and audio
  self-attention, text cross-attention for each stream, and audio-to-video / video-to-audio
  cross-attention. As the real 2.0 config: 1x1 patches, split RoPE (`rope_type="split"`), no gated
  attention, no cross-attention AdaLN (`cross_attn_mod=False`), its own caption projections
  (`use_prompt_embeddings=True`) and `perturbed_attn=False`. Video and audio have the same head count
  (the a2v/v2a RoPE assumes it), even, so 2-way Ulysses splits both streams; the audio head is half the
  video head, as 64 vs 128 in the real one;
- `vae`: `AutoencoderKLLTX2Video` with the real strides (patch 4, then spatial, temporal and two
  spatiotemporal downsamples: 32x spatially, 8x in time, causal first frame: F' = (F - 1) / 8 + 1);
- `audio_vae`: `AutoencoderKLLTX2Audio` over stereo mel spectrograms (16 kHz, hop 160 as the real one),
  4x in time and in mel bins. Its per-channel statistics have `base_channels` entries but normalize
  the packed audio tokens (latent_channels * mel_bins / 4 features), so the tiny one keeps
  base_channels equal to that product (the real one: 128 = 8 * 64 / 4);
- `vocoder`: `LTX2Vocoder` (HiFi-GAN style) with the real upsampling factors (6, 5, 2, 2, 2): 240
  waveform samples per mel frame, 100 mel frames a second, so 24 kHz out (`output_sampling_rate`);
- `connectors`: `LTX2TextConnectors`: a projection of all of Gemma's stacked hidden states, then a
  video and an audio 1-D transformer, each with 128 learnable registers that replace the padding
  tokens, as the real one (so `max_sequence_length` must be a multiple of 128, as for the real model);
- `text_encoder`: a tiny `Gemma3ForConditionalGeneration` (what `AutoModelForImageTextToText` gives for
  the real gemma-3-12b-it), with a tiny SigLIP tower the text path never runs. The pipeline stacks
  all `num_hidden_layers + 1` hidden states, so the connectors' `text_proj_in_factor` is that number
  (real: 49) and their `caption_channels` Gemma's width (real: 3840);
- `tokenizer`: a word-level `PreTrainedTokenizerFast` with Gemma's special ids (<pad> 0, <eos> 1,
  <bos> 2, <unk> 3, then the image markers) that prepends <bos> as Gemma's does; the pipeline switches
  it to left padding;
- `scheduler`: `FlowMatchEulerDiscreteScheduler` with the conversion script's non-distilled config
  (`REAL_SCHEDULER_CONFIG`: resolution-dependent shift between 0.95 and 2.05, terminal sigma 0.1).

Guidance. The pipeline's defaults run CFG, STG and modality-isolation guidance: three transformer
calls per step (the negative and positive prompts batched, then one STG and one modality-isolated
call, each batch 1). STG perturbs the self-attention of the blocks in `spatio_temporal_guidance_blocks`
(default [28], diffusers' value for LTX-2.3; its docstring recommends [29] for LTX-2.0's 48 blocks),
but only in blocks built with `perturbed_attn=True` (`LTX2PerturbedAttnProcessor`, LTX-2.3). LTX-2.0's
config has it False, so in diffusers STG on LTX-2.0 is an unperturbed extra call whose delta is zero
up to rounding. The tiny transformer has `TinyLTX2Config.layers` (2) blocks and silently ignores block
indices it lacks, so callers pass `spatio_temporal_guidance_blocks=[1]` (`STG_BLOCKS`, its last block,
as 28/29 are late blocks of 48) rather than rely on [28]. `TinyLTX2Config(perturbed_attn=True)`
builds the 2.3-style perturbed processor for tests of STG itself.

`build_tiny_ltx2()` returns the pipeline; `CALL_KWARGS` are sizes that run a 2-step generation in
seconds on CPU; `save_tiny_ltx2(path)` writes it with safetensors for `LTX2Pipeline.from_pretrained`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2ImageToVideoPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    PreTrainedTokenizerFast,
    SiglipVisionConfig,
)

from runtime.models.ltx2 import checkpoint  # the public checkpoint's configs
from tiny_wan.build import VOCAB_WORDS

# The real Lightricks/LTX-2 configs, as diffusers' scripts/convert_ltx2_to_diffusers.py writes them for
# `--version 2.0` (get_ltx2_*_config, and the scheduler of --full_pipeline for the non-distilled
# checkpoint; the distilled one turns dynamic shifting off and drops shift_terminal). The tiny model is
# these with the sizes of `TinyLTX2Config` put in; every other key stays.
REAL_TRANSFORMER_CONFIG = MappingProxyType(
    {
        "in_channels": 128,
        "out_channels": 128,
        "patch_size": 1,
        "patch_size_t": 1,
        "num_attention_heads": 32,
        "attention_head_dim": 128,
        "cross_attention_dim": 4096,
        "vae_scale_factors": (8, 32, 32),
        "pos_embed_max_pos": 20,
        "base_height": 2048,
        "base_width": 2048,
        "gated_attn": False,
        "cross_attn_mod": False,
        "audio_in_channels": 128,
        "audio_out_channels": 128,
        "audio_patch_size": 1,
        "audio_patch_size_t": 1,
        "audio_num_attention_heads": 32,
        "audio_attention_head_dim": 64,
        "audio_cross_attention_dim": 2048,
        "audio_scale_factor": 4,
        "audio_pos_embed_max_pos": 20,
        "audio_sampling_rate": 16000,
        "audio_hop_length": 160,
        "audio_gated_attn": False,
        "audio_cross_attn_mod": False,
        "num_layers": 48,
        "activation_fn": "gelu-approximate",
        "qk_norm": "rms_norm_across_heads",
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
        "caption_channels": 3840,
        "attention_bias": True,
        "attention_out_bias": True,
        "rope_theta": 10000.0,
        "rope_double_precision": True,
        "causal_offset": 1,
        "timestep_scale_multiplier": 1000,
        "cross_attn_timestep_scale_multiplier": 1000,
        "rope_type": "split",
        "use_prompt_embeddings": True,
        "perturbed_attn": False,
    }
)
REAL_CONNECTORS_CONFIG = MappingProxyType(
    {
        **checkpoint.CONNECTORS,
        "video_gated_attn": False,
        "audio_gated_attn": False,
        "rope_theta": 10000.0,
        "rope_double_precision": True,
        "causal_temporal_positioning": False,
        "per_modality_projections": False,
        "proj_bias": False,
    }
)
REAL_VIDEO_VAE_CONFIG = MappingProxyType(
    {
        "in_channels": 3,
        "out_channels": 3,
        "latent_channels": 128,
        "block_out_channels": (256, 512, 1024, 2048),
        "down_block_types": ("LTX2VideoDownBlock3D",) * 4,
        "decoder_block_out_channels": (256, 512, 1024),
        "layers_per_block": (4, 6, 6, 2, 2),
        "decoder_layers_per_block": (5, 5, 5, 5),
        "spatio_temporal_scaling": (True, True, True, True),
        "decoder_spatio_temporal_scaling": (True, True, True),
        "decoder_inject_noise": (False, False, False, False),
        "downsample_type": ("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        "upsample_type": ("spatiotemporal", "spatiotemporal", "spatiotemporal"),
        "upsample_residual": (True, True, True),
        "upsample_factor": (2, 2, 2),
        "timestep_conditioning": False,  # the script's default (its --timestep_conditioning flag unset)
        "patch_size": 4,
        "patch_size_t": 1,
        "resnet_norm_eps": 1e-6,
        "encoder_causal": True,
        "decoder_causal": False,
        "encoder_spatial_padding_mode": "zeros",
        "decoder_spatial_padding_mode": "reflect",
        "spatial_compression_ratio": 32,
        "temporal_compression_ratio": 8,
    }
)
REAL_AUDIO_VAE_CONFIG = MappingProxyType(
    {**checkpoint.AUDIO_VAE, "attn_resolutions": None, "resolution": 256, "dropout": 0.0}
)
REAL_VOCODER_CONFIG = MappingProxyType(
    {
        **checkpoint.VOCODER,
        "act_fn": "leaky_relu",
        "leaky_relu_negative_slope": 0.1,
        "antialias": False,
        "final_act_fn": "tanh",
        "final_bias": True,
    }
)
REAL_SCHEDULER_CONFIG = MappingProxyType(dict(checkpoint.SCHEDULER))
STG_BLOCKS = (1,)  # the tiny transformer's last block; the pipeline's default [28] does not exist here
# Gemma's special tokens in Gemma's id order, then the image markers Gemma3ForConditionalGeneration names.
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
# A call that works on the tiny model: 64 x 64 gives a 2 x 2 latent, 9 frames (8k + 1) 2 latent frames;
# 9 frames at 24 fps are 0.375 s of audio: round(0.375 * 16000 / 160 / 4) = 9 audio latent frames.
# max_sequence_length: a multiple of the connectors' 128 registers (the pipeline's default is 1024).
CALL_KWARGS = MappingProxyType(
    {
        "height": 64,
        "width": 64,
        "num_frames": 9,
        "frame_rate": 24.0,
        "num_inference_steps": 2,
        "spatio_temporal_guidance_blocks": list(STG_BLOCKS),
        "max_sequence_length": 128,
    }
)


@dataclass(frozen=True)
class TinyLTX2Config:
    """Sizes of the tiny LTX-2 (the real values in comments). Changing any number changes the weights."""

    # transformer: video heads x head_dim (real 32 x 128), audio heads x head_dim (real 32 x 64)
    heads: int = 2
    head_dim: int = 16
    audio_head_dim: int = 8
    layers: int = 2  # real: 48
    perturbed_attn: bool = False  # real LTX-2.0: False (True is LTX-2.3's STG processor)
    # video VAE: latent channels (real 128), encoder widths (real (256, 512, 1024, 2048)),
    # decoder widths (real (256, 512, 1024)), resnets per encoder / decoder block (real (4, 6, 6, 2, 2)
    # and (5, 5, 5, 5))
    latent_channels: int = 16
    vae_channels: tuple[int, int, int, int] = (8, 16, 32, 32)
    vae_decoder_channels: tuple[int, int, int] = (8, 16, 32)
    vae_layers: tuple[int, ...] = (1, 1, 1, 1, 1)
    vae_decoder_layers: tuple[int, ...] = (1, 1, 1, 1)
    # audio VAE: stereo mel in and out (real: 64 mel bins, 8 latent channels, 128 base channels,
    # 2 resnets a level); base_channels must be audio_latent_channels * mel_bins / 4 (see the docstring)
    mel_bins: int = 16
    audio_latent_channels: int = 4
    audio_base_channels: int = 16
    audio_res_blocks: int = 1
    # vocoder width (real 1024), halved by each of the 5 upsamplers
    vocoder_channels: int = 32
    # Gemma 3 text model (real gemma-3-12b: 3840 wide, 48 layers, 16 heads / 8 kv of 256, 15360 MLP)
    gemma_dim: int = 32
    gemma_layers: int = 3
    gemma_heads: int = 2
    gemma_kv_heads: int = 1
    gemma_head_dim: int = 16
    gemma_ffn: int = 64
    # connectors: per stream, heads x head_dim must equal gemma_dim (real 30 x 128 = 3840), 2 layers,
    # 128 learnable registers (both as the real one)
    connector_heads: int = 2
    connector_layers: int = 2
    registers: int = 128
    max_sequence_length: int = 1024  # the tokenizer's model_max_length, the pipeline's default length
    vocab: tuple[str, ...] = field(default=VOCAB_WORDS)

    def __post_init__(self) -> None:
        if self.heads % 2:
            raise ValueError(f"heads={self.heads} must be even so 2-way Ulysses splits both streams; try 2")
        # split RoPE gives each head (inner_dim / 2) / heads frequencies; the a2v/v2a RoPE is built
        # with the video head count over the audio width
        for name, dim in (("head_dim", self.head_dim), ("audio_head_dim", self.audio_head_dim)):
            if dim % 2:
                raise ValueError(f"{name}={dim} must be even (split RoPE); try {dim + 1}")
        # the connectors work at Gemma's width, split RoPE again: gemma_dim / 2 frequencies over their heads
        if self.gemma_dim % (2 * self.connector_heads):
            raise ValueError(
                f"gemma_dim={self.gemma_dim} must be a multiple of 2 * connector_heads ({self.connector_heads})"
            )
        if self.gemma_heads % self.gemma_kv_heads:
            raise ValueError("gemma_heads must be a multiple of gemma_kv_heads")
        if self.mel_bins % 4:
            raise ValueError(f"mel_bins={self.mel_bins} must be a multiple of 4 (the audio VAE's compression)")
        if self.audio_base_channels != self.audio_tokens_dim:
            raise ValueError(
                f"audio_base_channels={self.audio_base_channels} must equal audio_latent_channels * mel_bins / 4"
                f" = {self.audio_tokens_dim}: the audio VAE's statistics normalize the packed audio tokens"
            )
        if self.vocoder_channels % 2**5:
            raise ValueError(f"vocoder_channels={self.vocoder_channels} must be a multiple of 32 (5 halvings)")
        if self.max_sequence_length % self.registers:
            raise ValueError(f"max_sequence_length must be a multiple of registers ({self.registers})")
        if len(self.vae_layers) != 5 or len(self.vae_decoder_layers) != 4:
            raise ValueError("vae_layers needs 5 entries (4 blocks, mid) and vae_decoder_layers 4 (mid, 3 blocks)")

    @property
    def inner_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def audio_inner_dim(self) -> int:
        return self.heads * self.audio_head_dim

    @property
    def audio_tokens_dim(self) -> int:
        """Features of one packed audio token: latent channels x latent mel bins."""
        return self.audio_latent_channels * self.mel_bins // 4


TINY_LTX2 = TinyLTX2Config()


def build_gemma_tokenizer(words: tuple[str, ...] = VOCAB_WORDS, max_length: int = 1024) -> PreTrainedTokenizerFast:
    """Word-level, Gemma's special ids, <bos> prepended (Gemma adds no <eos>), lower-cased, words and
    punctuation split apart. Unknown words map to <unk>."""
    vocab = {token: i for i, token in enumerate(GEMMA_SPECIALS)}
    for word in words:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A $B", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    tok.add_special_tokens(list(GEMMA_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        padding_side="left",
        model_max_length=max_length,
    )


def _gemma(cfg: TinyLTX2Config, tokenizer: PreTrainedTokenizerFast) -> Gemma3ForConditionalGeneration:
    ids = tokenizer.convert_tokens_to_ids
    text = Gemma3TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.gemma_dim,
        intermediate_size=cfg.gemma_ffn,
        num_hidden_layers=cfg.gemma_layers,
        num_attention_heads=cfg.gemma_heads,
        num_key_value_heads=cfg.gemma_kv_heads,
        head_dim=cfg.gemma_head_dim,
        query_pre_attn_scalar=cfg.gemma_head_dim,  # gemma-3-12b: its head dim, 256
        max_position_embeddings=2 * cfg.max_sequence_length,
        sliding_window=cfg.max_sequence_length,  # gemma-3-12b: 1024
        # gemma-3 alternates 5 sliding-window layers with 1 global one; keep one of each kind
        layer_types=["sliding_attention"] * (cfg.gemma_layers - 1) + ["full_attention"],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    vision = SiglipVisionConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=4
    )
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,  # 4 x 4 patches pooled to 2 x 2 (real: 64 x 64 to 16 x 16)
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
    )
    return Gemma3ForConditionalGeneration(config)


def tiny_configs(cfg: TinyLTX2Config = TINY_LTX2) -> dict[str, dict]:
    """The constructor arguments of the tiny transformer, connectors, vae, audio_vae and vocoder: the
    real configs (REAL_*_CONFIG) with only widths, depths and the latent sizes replaced."""
    return {
        "transformer": {
            **REAL_TRANSFORMER_CONFIG,
            "in_channels": cfg.latent_channels,
            "out_channels": cfg.latent_channels,
            "num_attention_heads": cfg.heads,
            "attention_head_dim": cfg.head_dim,
            "cross_attention_dim": cfg.inner_dim,  # the caption projection's width (real 4096 = 32 x 128)
            "audio_in_channels": cfg.audio_tokens_dim,
            "audio_out_channels": cfg.audio_tokens_dim,
            "audio_num_attention_heads": cfg.heads,
            "audio_attention_head_dim": cfg.audio_head_dim,
            "audio_cross_attention_dim": cfg.audio_inner_dim,  # real 2048 = 32 x 64
            "num_layers": cfg.layers,
            "caption_channels": cfg.gemma_dim,
            "perturbed_attn": cfg.perturbed_attn,
        },
        "connectors": {
            **REAL_CONNECTORS_CONFIG,
            "caption_channels": cfg.gemma_dim,
            "text_proj_in_factor": cfg.gemma_layers + 1,  # the embeddings and every layer's output
            "video_connector_num_attention_heads": cfg.connector_heads,
            "video_connector_attention_head_dim": cfg.gemma_dim // cfg.connector_heads,
            "video_connector_num_layers": cfg.connector_layers,
            "video_connector_num_learnable_registers": cfg.registers,
            "audio_connector_num_attention_heads": cfg.connector_heads,
            "audio_connector_attention_head_dim": cfg.gemma_dim // cfg.connector_heads,
            "audio_connector_num_layers": cfg.connector_layers,
            "audio_connector_num_learnable_registers": cfg.registers,
        },
        "vae": {
            **REAL_VIDEO_VAE_CONFIG,
            "latent_channels": cfg.latent_channels,
            "block_out_channels": cfg.vae_channels,
            "decoder_block_out_channels": cfg.vae_decoder_channels,
            "layers_per_block": cfg.vae_layers,
            "decoder_layers_per_block": cfg.vae_decoder_layers,
        },
        "audio_vae": {
            **REAL_AUDIO_VAE_CONFIG,
            "base_channels": cfg.audio_base_channels,
            "num_res_blocks": cfg.audio_res_blocks,
            "latent_channels": cfg.audio_latent_channels,
            "mel_bins": cfg.mel_bins,
        },
        "vocoder": {
            **REAL_VOCODER_CONFIG,
            "in_channels": 2 * cfg.mel_bins,  # the stereo mel spectrogram, channels x bins (real 2 x 64)
            "hidden_channels": cfg.vocoder_channels,
        },
    }


_CLASSES = {
    "transformer": LTX2VideoTransformer3DModel,
    "connectors": LTX2TextConnectors,
    "vae": AutoencoderKLLTX2Video,
    "audio_vae": AutoencoderKLLTX2Audio,
    "vocoder": LTX2Vocoder,
}


def build_tiny_ltx2_components(seed: int = 0, cfg: TinyLTX2Config = TINY_LTX2) -> dict:
    """The components of `LTX2Pipeline` (and of `LTX2ImageToVideoPipeline`, which takes the same):
    {scheduler, vae, audio_vae, text_encoder, tokenizer, connectors, transformer, vocoder}, each module
    from its own seed (seed, seed + 1, ...), in eval mode without gradients. The global torch RNG is
    left as it was."""
    tokenizer = build_gemma_tokenizer(cfg.vocab, cfg.max_sequence_length)
    parts: dict = {}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts["text_encoder"] = _gemma(cfg, tokenizer)
        for offset, (name, kwargs) in enumerate(tiny_configs(cfg).items(), start=1):
            torch.manual_seed(seed + offset)
            parts[name] = _CLASSES[name](**kwargs)
    for module in parts.values():
        module.eval().requires_grad_(False)
    parts["tokenizer"] = tokenizer
    parts["scheduler"] = FlowMatchEulerDiscreteScheduler(**REAL_SCHEDULER_CONFIG)
    return parts


def build_tiny_ltx2(image: bool = False, seed: int = 0, cfg: TinyLTX2Config = TINY_LTX2) -> LTX2Pipeline:
    """The tiny `LTX2Pipeline`, or with `image` the `LTX2ImageToVideoPipeline` (same weights). Its
    progress bar is off. Run it with `**CALL_KWARGS` (see the module docstring for the STG blocks)."""
    cls = LTX2ImageToVideoPipeline if image else LTX2Pipeline
    pipe = cls(**build_tiny_ltx2_components(seed, cfg))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_ltx2(path: str | Path, image: bool = False, seed: int = 0, cfg: TinyLTX2Config = TINY_LTX2) -> Path:
    """Write the tiny pipeline to `path` (safetensors, model_index.json); `LTX2Pipeline.from_pretrained(path)`
    (or `LTX2ImageToVideoPipeline`'s) loads it back with identical weights."""
    path = Path(path)
    build_tiny_ltx2(image, seed, cfg).save_pretrained(path, safe_serialization=True)
    return path
