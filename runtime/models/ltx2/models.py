"""The LTX-2 family's named models: Lightricks' diffusers-format LTX-2 (2.0), with the configs and
counts the registry, the memory model and the meta-device builds read (tests/test_ltx2.py rebuilds
each count). The configs are those of diffusers' scripts/convert_ltx2_to_diffusers.py for version
2.0 and its non-distilled scheduler."""

from __future__ import annotations

from runtime.models.ltx2.checkpoint import T2V
from runtime.models.protocol import NamedModel, TextEncoders

# LTX2VideoTransformer3DModel's defaults are the 19B model's but for these.
TRANSFORMER = {"rope_type": "split", "perturbed_attn": False, "gated_attn": False, "cross_attn_mod": False}
TRANSFORMER_PARAMS = 18_876_174_592
VAE = {
    "latent_channels": 128, "block_out_channels": [256, 512, 1024, 2048], "decoder_block_out_channels": [256, 512, 1024],
    "layers_per_block": [4, 6, 6, 2, 2], "decoder_layers_per_block": [5, 5, 5, 5],
    "spatio_temporal_scaling": [True, True, True, True], "decoder_spatio_temporal_scaling": [True, True, True],
    "decoder_inject_noise": [False, False, False, False],
    "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
    "upsample_type": ["spatiotemporal", "spatiotemporal", "spatiotemporal"], "upsample_residual": [True, True, True],
    "upsample_factor": [2, 2, 2], "timestep_conditioning": False, "patch_size": 4, "patch_size_t": 1,
    "encoder_causal": True, "decoder_causal": False, "spatial_compression_ratio": 32, "temporal_compression_ratio": 8,
}  # fmt: skip
VAE_PARAMS = 1_222_479_601
# Gemma 3 12B (48 layers of 224,148,992; embeddings, norm and the vision tower outside them) and
# the connectors (1,431,475,200), which --shard-weights leaves whole.
TEXT = TextEncoders(12_202_563_392 + 1_431_475_200, 224_148_992, 1_443_411_776, 1_431_475_200)

MODELS = (
    NamedModel("ltx-2", "LTX-2 19B text- or image-to-video with audio (32x/8x VAE, 24 kHz stereo)", T2V, TRANSFORMER,
               TRANSFORMER_PARAMS, VAE, VAE_PARAMS, TEXT, repo_id="Lightricks/LTX-2"),
)  # fmt: skip
