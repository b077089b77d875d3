"""Build a tiny random SkyReels-V2 in code, deterministically and offline.

Every component is the class a Skywork SkyReels-V2 diffusers checkpoint loads into, so the
tiny model runs the code path of the real ones through diffusers' `SkyReelsV2Pipeline` and
`SkyReelsV2ImageToVideoPipeline`:

- `transformer`: `SkyReelsV2Transformer3DModel` (no fps embedding, no causal blocks, as the
  text- and image-to-video checkpoints);
- `tokenizer`, `text_encoder`, `vae`: tiny_wan.build's word-level tokenizer, tiny UMT5 and
  seeded `AutoencoderKLWan` (Wan2.1's VAE, 8x spatially, 4x in time);
- `scheduler`: `UniPCMultistepScheduler` on flow sigmas, with the flow shift the pipelines'
  examples set (8 for text-, 5 for image-to-video);
- image-to-video: a tiny `CLIPVisionModelWithProjection` and a `CLIPProcessor` (what the public
  checkpoints save: its image half is what the pipeline calls), and a transformer taking the
  condition channels and CLIP's penultimate hidden states.

`SkyReelsV2Pipeline(**build_tiny_skyreels())`, or
`SkyReelsV2ImageToVideoPipeline(**build_tiny_skyreels(image=True))`.
"""

from __future__ import annotations

import torch
from diffusers import SkyReelsV2Transformer3DModel, UniPCMultistepScheduler

from tiny_wan.build import VAE_TEMPORAL_STRIDE, TinyWanConfig, build_tiny_wan, build_tokenizer

# 2 heads of 12 (Ulysses 2 and tp 2 are legal), 2 layers: seconds on CPU.
TINY = dict(heads=2, head_dim=12, layers=2, ffn_dim=32, text_dim=24, text_heads=2)
FLOW_SHIFT = {False: 8.0, True: 5.0}  # by image-to-video, as the pipelines' examples set it
CLIP_DIM, CLIP_SIZE, CLIP_PATCH = 32, 32, 8


def build_tiny_skyreels(image: bool = False, seed: int = 21) -> dict:
    """The pipeline components {tokenizer, text_encoder, transformer, vae, scheduler}, plus
    {image_encoder, image_processor} with `image`; each from its own seed."""
    cfg = TinyWanConfig(seed=seed, **TINY, flow_shift=FLOW_SHIFT[image])
    wan = build_tiny_wan(cfg)
    components = {k: wan[k] for k in ("tokenizer", "text_encoder", "vae")}
    extra: dict = {}
    if image:
        # the condition's mask (one channel per frame of a latent frame) and latents join the noise
        extra = {"in_channels": 2 * cfg.z_dim + VAE_TEMPORAL_STRIDE, "image_dim": CLIP_DIM}
        extra["added_kv_proj_dim"] = cfg.heads * cfg.head_dim
        components.update(_clip(seed + 3))
    torch.manual_seed(seed + 1)
    components["transformer"] = SkyReelsV2Transformer3DModel(
        patch_size=cfg.patch_size,
        num_attention_heads=cfg.heads,
        attention_head_dim=cfg.head_dim,
        in_channels=extra.pop("in_channels", cfg.z_dim),
        out_channels=cfg.z_dim,
        text_dim=cfg.text_dim,
        freq_dim=64,
        ffn_dim=cfg.ffn_dim,
        num_layers=cfg.layers,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        rope_max_seq_len=256,
        **extra,
    )
    components["scheduler"] = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, num_train_timesteps=1000, flow_shift=cfg.flow_shift
    )
    for module in components.values():
        if isinstance(module, torch.nn.Module):
            module.eval().requires_grad_(False)
    return components


def _clip(seed: int) -> dict:
    """A tiny CLIP ViT with its projection, and a CLIPProcessor over a word-level tokenizer."""
    from transformers import CLIPImageProcessor, CLIPProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

    torch.manual_seed(seed)
    encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=CLIP_DIM,
            intermediate_size=2 * CLIP_DIM,
            projection_dim=CLIP_DIM,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=CLIP_SIZE,
            patch_size=CLIP_PATCH,
            hidden_act="gelu",
        )
    )
    pixels = CLIPImageProcessor(size={"shortest_edge": CLIP_SIZE}, crop_size={"height": CLIP_SIZE, "width": CLIP_SIZE})
    return {
        "image_encoder": encoder,
        "image_processor": CLIPProcessor(image_processor=pixels, tokenizer=build_tokenizer()),
    }
