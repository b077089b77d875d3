"""Tiny random models of the Wan families diffusers runs (tiny_wan.build), through diffusers' own
pipelines: Wan2.2 T2V A14B (two experts), Wan2.2 TI2V-5B (Wan2.2 VAE, per-token timesteps;
text- and image-to-video), Wan2.1 I2V (CLIP image encoder) and Wan2.2 I2V A14B (two experts,
condition latents only). Each runs on CPU, gives finite latents of the expected shape, and
saves and loads (safetensors, offline) to the same latents."""

from __future__ import annotations

import importlib.util

import numpy as np
import PIL.Image
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline

from tiny_wan.build import TinyWanConfig, build_tiny_wan, pipeline_class, pipeline_kwargs

TINY = dict(seed=7, heads=2, head_dim=12, layers=2, ffn_dim=32, text_dim=24, text_heads=2)
# Three steps of flow_shift 3 are t = 999, 857, 600: with Wan2.2's own boundaries (0.875 T2V,
# 0.9 I2V) the first step runs `transformer` and the last two `transformer_2`.
T2V_A14B = TinyWanConfig(**TINY, experts=2, boundary_ratio=0.875)
TI2V_5B = TinyWanConfig(**TINY, vae22=True, expand_timesteps=True, z_dim=48)
I2V_21 = TinyWanConfig(**TINY, image="clip")
I2V_A14B = TinyWanConfig(**TINY, image="latent", experts=2, boundary_ratio=0.9)

STEPS = 3
FRAMES = 5  # two latent frames
TEXT_LEN = 32
ROUND_TRIP_ATOL = 1e-5  # the parity bound of test_parity, float32 on CPU


def image(seed: int = 0) -> PIL.Image.Image:
    """A seeded random RGB image, not square and not the video's size (both pipelines resize)."""
    return PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 48, 3), dtype=np.uint8))


def run(pipe, size: int, img: PIL.Image.Image | None = None) -> torch.Tensor:
    kwargs = {"image": img} if img is not None else {}
    if img is not None:
        assert importlib.util.find_spec("ftfy"), (
            "WanImageToVideoPipeline's prompt_clean -> basic_clean calls ftfy.fix_text unconditionally "
            "(NameError: name 'ftfy' is not defined without it); install ftfy"
        )
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt="a red circle moving left",
        negative_prompt="blurry, static",
        height=size,
        width=size,
        num_frames=FRAMES,
        num_inference_steps=STEPS,
        guidance_scale=3.5,
        generator=torch.Generator("cpu").manual_seed(0),
        output_type="latent",
        max_sequence_length=TEXT_LEN,
        **kwargs,
    ).frames


def record_calls(pipe) -> dict[str, list[dict]]:
    """The keyword arguments of every call of each transformer."""
    calls: dict[str, list[dict]] = {}
    for name in ("transformer", "transformer_2"):
        module = getattr(pipe, name, None)
        if module is not None:
            calls[name] = []
            module.register_forward_pre_hook(lambda _m, _a, kw, name=name: calls[name].append(kw), with_kwargs=True)
    return calls


def round_trip(pipe, cls, path, size, img=None) -> tuple[torch.Tensor, object]:
    """Latents of `pipe`, checked finite and identical after save_pretrained/from_pretrained."""
    latents = run(pipe, size, img)
    assert torch.isfinite(latents).all()
    pipe.save_pretrained(path, safe_serialization=True)
    assert not list(path.rglob("*.bin")), "everything is safetensors"
    loaded = cls.from_pretrained(path, local_files_only=True)
    assert type(loaded) is cls
    assert (loaded.config.boundary_ratio, loaded.config.expand_timesteps) == (
        pipe.config.boundary_ratio,
        pipe.config.expand_timesteps,
    )
    present = {name for name, part in pipe.components.items() if part is not None}
    assert {name for name, part in loaded.components.items() if part is not None} == present
    for name in present:
        module = getattr(pipe, name)
        if isinstance(module, torch.nn.Module):
            want, got = module.state_dict(), getattr(loaded, name).state_dict()
            assert want.keys() == got.keys(), name
            assert all(torch.equal(want[k], got[k]) for k in want), name
    # Loaded as is, the weights lie where safetensors put them, not 64-byte aligned as torch's
    # allocator puts them; CPU kernels then round differently (~1e-6 here).
    assert (run(loaded, size, img) - latents).abs().max().item() <= ROUND_TRIP_ATOL
    # In fresh (aligned) memory the same weights give bit-identical latents.
    with torch.no_grad():
        for name in present:
            module = getattr(loaded, name)
            if isinstance(module, torch.nn.Module):
                for tensor in [*module.parameters(), *module.buffers()]:
                    tensor.data = tensor.data.clone()
    assert torch.equal(run(loaded, size, img), latents)
    return latents, loaded


def assert_second_expert_matters(calls, loaded, size, img, latents) -> None:
    """transformer_2 ran the low-noise steps (`calls` of the run that gave `latents`), and its own
    weights change the result."""
    assert loaded.config.boundary_ratio is not None
    # CFG: two calls a step; t=999 goes to transformer, t=857 and t=600 fall below the boundary.
    assert [len(calls["transformer"]), len(calls["transformer_2"])] == [2, 4]
    assert [float(c["timestep"][0]) for c in calls["transformer_2"]] == [857.0, 857.0, 600.0, 600.0]
    t1, t2 = loaded.transformer.state_dict(), loaded.transformer_2.state_dict()
    assert t1.keys() == t2.keys() and not all(torch.equal(t1[k], t2[k]) for k in t1)
    loaded.transformer_2.load_state_dict(t1)
    assert not torch.allclose(run(loaded, size, img), latents, atol=1e-4)


def condition_latents(pipe, size: int, frames: int) -> torch.Tensor:
    """The normalized VAE latents of image() followed by frames - 1 black (zero) frames."""
    vae = pipe.vae
    pixels = pipe.video_processor.preprocess(image(), height=size, width=size).unsqueeze(2)
    video = torch.cat([pixels, pixels.new_zeros(1, 3, frames - 1, size, size)], dim=2)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    with torch.no_grad():
        return (vae.encode(video).latent_dist.mode() - mean) / std


def test_family_configs_build_their_components():
    plain = build_tiny_wan(TinyWanConfig(**TINY))
    assert sorted(plain) == ["scheduler", "text_encoder", "tokenizer", "transformer", "vae"]
    assert pipeline_class(TinyWanConfig()) is WanPipeline
    assert pipeline_kwargs(TinyWanConfig()) == {"boundary_ratio": None, "expand_timesteps": False}

    two = build_tiny_wan(T2V_A14B)
    assert sorted(two) == ["scheduler", "text_encoder", "tokenizer", "transformer", "transformer_2", "vae"]
    assert two["transformer_2"].config == two["transformer"].config
    # The first expert is the plain model's: adding one never changes another component.
    for key, value in plain["transformer"].state_dict().items():
        assert torch.equal(two["transformer"].state_dict()[key], value), key
    assert pipeline_kwargs(T2V_A14B) == {"boundary_ratio": 0.875, "expand_timesteps": False}

    clip = build_tiny_wan(I2V_21)
    assert {"image_encoder", "image_processor"} <= clip.keys() and "transformer_2" not in clip
    cfg = clip["transformer"].config
    assert (cfg.in_channels, cfg.out_channels, cfg.image_dim, cfg.added_kv_proj_dim) == (36, 16, 32, 24)
    assert pipeline_class(I2V_21) is WanImageToVideoPipeline

    latent = build_tiny_wan(I2V_A14B)
    assert "image_encoder" not in latent and latent["transformer"].config.image_dim is None
    assert latent["transformer"].config.in_channels == 36 and latent["transformer_2"].config.in_channels == 36

    ti2v = build_tiny_wan(TI2V_5B)
    vae = ti2v["vae"].config
    assert (vae.is_residual, vae.patch_size, vae.in_channels, vae.out_channels) == (True, 2, 12, 12)
    assert (vae.z_dim, vae.scale_factor_spatial, vae.scale_factor_temporal) == (48, 16, 4)
    assert vae.decoder_base_dim != vae.base_dim
    assert ti2v["transformer"].config.in_channels == ti2v["transformer"].config.out_channels == 48
    assert pipeline_class(TI2V_5B) is WanPipeline
    assert pipeline_kwargs(TI2V_5B) == {"boundary_ratio": None, "expand_timesteps": True}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"experts": 3}, "experts must be 1 or 2"),
        ({"boundary_ratio": 0.5}, "boundary_ratio needs experts=2"),
        ({"experts": 2, "boundary_ratio": 1.5}, r"boundary_ratio must be in \(0, 1\)"),
        ({"image": "vision"}, "image must be one of"),
        ({"vae22": True, "vae": "pooling", "z_dim": 12}, "vae22 .* needs vae='random'"),
        ({"expand_timesteps": True, "image": "clip"}, "image must be 'none'"),
        ({"expand_timesteps": True, "patch_size": (1, 1, 1)}, r"needs patch_size \(1, 2, 2\)"),
    ],
)
def test_contradictory_family_configs_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TinyWanConfig(**kwargs)


def test_wan22_t2v_two_experts(tmp_path):
    pipe = pipeline_class(T2V_A14B)(**build_tiny_wan(T2V_A14B), **pipeline_kwargs(T2V_A14B))
    calls = record_calls(pipe)
    latents, loaded = round_trip(pipe, WanPipeline, tmp_path / "t2v-a14b", 32)
    assert latents.shape == (1, 16, 2, 4, 4)
    assert_second_expert_matters(calls, loaded, 32, None, latents)


def test_wan22_ti2v_text_to_video(tmp_path):
    pipe = pipeline_class(TI2V_5B)(**build_tiny_wan(TI2V_5B), **pipeline_kwargs(TI2V_5B))
    calls = record_calls(pipe)
    latents, loaded = round_trip(pipe, WanPipeline, tmp_path / "ti2v-t2v", 64)
    assert latents.shape == (1, 48, 2, 4, 4)  # 64 pixels / 16
    # One timestep per token (2 frames x 2 x 2 patches), all the same in text-to-video.
    for call in calls["transformer"]:
        timestep = call["timestep"]
        assert timestep.shape == (1, 8) and torch.all(timestep == timestep[0, 0]) and timestep[0, 0] > 0
    # The Wan2.2 VAE decodes 48 channels back to 12 = 3 x 2 x 2 and unpatchifies them to RGB.
    with torch.no_grad():
        video = loaded.vae.decode(latents).sample
    assert video.shape == (1, 3, FRAMES, 64, 64) and torch.isfinite(video).all()


def test_wan22_ti2v_image_to_video(tmp_path):
    # The same components as TI2V text-to-video (no image encoder), through the I2V pipeline.
    components = build_tiny_wan(TI2V_5B)
    assert "image_encoder" not in components
    pipe = WanImageToVideoPipeline(**components, **pipeline_kwargs(TI2V_5B))
    calls = record_calls(pipe)
    latents, loaded = round_trip(pipe, WanImageToVideoPipeline, tmp_path / "ti2v-i2v", 64, image())
    assert latents.shape == (1, 48, 2, 4, 4)
    # The first latent frame is the image's (normalized) latents, its 4 tokens at timestep 0 throughout.
    for call in calls["transformer"]:
        assert call["hidden_states"].shape == (1, 48, 2, 4, 4) and call["encoder_hidden_states_image"] is None
        timestep = call["timestep"]
        assert timestep.shape == (1, 8) and torch.all(timestep[0, :4] == 0) and torch.all(timestep[0, 4:] > 0)
    assert torch.allclose(latents[:, :, :1], condition_latents(loaded, 64, frames=1), atol=1e-5)
    other = run(loaded, 64, image(1))
    assert not torch.allclose(other[:, :, :1], latents[:, :, :1], atol=1e-3)


def test_wan21_i2v_clip(tmp_path):
    pipe = pipeline_class(I2V_21)(**build_tiny_wan(I2V_21), **pipeline_kwargs(I2V_21))
    calls = record_calls(pipe)
    latents, loaded = round_trip(pipe, WanImageToVideoPipeline, tmp_path / "i2v-21", 32, image())
    assert latents.shape == (1, 16, 2, 4, 4)
    call = calls["transformer"][0]
    # noise (16) + mask (4) + condition latents (16); CLIP's penultimate layer, 1 + (32/8)^2 tokens
    assert call["hidden_states"].shape == (1, 36, 2, 4, 4)
    assert call["encoder_hidden_states_image"].shape == (1, 17, 32)
    mask = call["hidden_states"][:, 16:20]
    assert torch.equal(mask[:, :, 0], torch.ones_like(mask[:, :, 0])) and not mask[:, :, 1:].any()
    assert call["timestep"].shape == (1,)
    # The image reaches the transformer twice, as condition latents and as CLIP embeddings (the
    # first of the two layers' output; diffusers takes hidden_states[-2]): other embeddings of the
    # same image change the result. (image_embeds= cannot say so: the pipeline refuses it with an image.)
    fc2 = next(m for n, m in loaded.image_encoder.named_modules() if n.endswith("encoder.layers.0.mlp.fc2"))
    with torch.no_grad():
        fc2.weight.mul_(2.0)
    assert not torch.allclose(run(loaded, 32, image()), latents, atol=1e-4)


def test_wan22_i2v_two_experts(tmp_path):
    pipe = pipeline_class(I2V_A14B)(**build_tiny_wan(I2V_A14B), **pipeline_kwargs(I2V_A14B))
    calls = record_calls(pipe)
    latents, loaded = round_trip(pipe, WanImageToVideoPipeline, tmp_path / "i2v-a14b", 32, image())
    assert latents.shape == (1, 16, 2, 4, 4)
    assert loaded.image_encoder is None and loaded.image_processor is None
    call = calls["transformer_2"][0]
    assert call["hidden_states"].shape == (1, 36, 2, 4, 4) and call["encoder_hidden_states_image"] is None
    # noise, 4 mask channels, then the latents of the image followed by black frames
    assert torch.allclose(call["hidden_states"][:, 20:], condition_latents(loaded, 32, FRAMES), atol=1e-5)
    assert_second_expert_matters(calls, loaded, 32, image(), latents)
