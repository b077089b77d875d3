"""What the denoising loop asks of a loaded LTX-2 checkpoint (`LTX2Pipeline`): Gemma text through
the pipeline's connectors (one stream for the video, one for the audio), video and audio noise
from one generator, the flow-matching sigmas shifted by the whole video's token count, and the
pipeline's own guidance, which this family runs itself (`guided_noise`): per step up to four
forwards (conditional, unconditional, spatio-temporal guidance with the self-attention of its
blocks skipped, modality isolation with the audio-video cross-attention off), combined as deltas
on the predicted clean sample of each stream, rescaled, and turned back into velocities. The
video latents are the loop's; the audio latents are this model's run state, stepped by a copy
of the scheduler as the pipeline steps them.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width, L audio
latent frames, M latent mel bins, S tokens, D token width.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import numpy as np
import torch

from basics.errors import ConfigError
from runtime.loop_types import TextEmbeds

# LTX2Pipeline.__call__'s guidance defaults: the video's CFG scale is the item's --guidance (3.0).
GUIDANCE = {
    "audio_guidance": 7.0,
    "stg": 1.0,
    "audio_stg": 1.0,
    "modality": 3.0,
    "audio_modality": 3.0,
    "rescale": 0.7,
    "audio_rescale": 0.7,
    "stg_blocks": (28,),
    "cross_timestep": True,
}


@dataclass(frozen=True)
class LTX2Text:
    """One CFG branch's text: the connectors' video and audio streams and their mask; `mode`:
    which forward it asks for ("plain", "stg": self-attention skipped in the STG blocks,
    "isolated": no audio-video cross-attention)."""

    video: torch.Tensor
    audio: torch.Tensor
    mask: torch.Tensor
    mode: str = "plain"

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.video.shape)


@dataclass(frozen=True)
class LTX2Condition:
    """An item's fixed inputs beside its video latents: the audio noise [1, L, C*M] (drawn after
    the video's from the item's generator), the audio latent frames and mel bins, the frame rate
    its positions are conditioned on, and for image-to-video the image's latents [1, C, 1, H, W]
    (normalised, float32): the first latent frame, held there while the others are denoised."""

    audio_noise: torch.Tensor
    audio_frames: int
    mel_bins: int
    fps: float
    image_BCFHW: torch.Tensor | None = None


@dataclass
class AudioRun:
    """The audio stream of the run in progress: its latents and its scheduler."""

    latents: torch.Tensor  # [1, L, C*M] float32
    scheduler: object
    sigmas: torch.Tensor  # the video scheduler's (the same values)
    image_BCFHW: torch.Tensor | None = None  # image-to-video: the first latent frame (LTX2Condition's)


def rescale(guided: torch.Tensor, plain: torch.Tensor, factor: float) -> torch.Tensor:
    """The pipeline's guidance rescale: `guided` scaled to the standard deviation of `plain`, mixed
    by `factor` (std over everything but the batch: a layout of the same elements gives the same)."""
    if factor <= 0:
        return guided
    dims = list(range(1, plain.ndim))
    rescaled = guided * (plain.std(dim=dims, keepdim=True) / guided.std(dim=dims, keepdim=True))
    return factor * rescaled + (1 - factor) * guided


def with_image(latents_BCFHW: torch.Tensor, image_BCFHW: torch.Tensor | None) -> torch.Tensor:
    """The video latents as the image-to-video pipeline holds them: the image's latents in the
    first frame (the pipeline's mix of image and noise by its mask gives exactly these)."""
    if image_BCFHW is None:
        return latents_BCFHW
    return torch.cat([image_BCFHW.to(latents_BCFHW.dtype), latents_BCFHW[:, :, 1:]], dim=2)


class LTX2Model:
    """LTX-2 with its audio, as `LTX2Pipeline` runs it (its default guidance), and with an image
    as `LTX2ImageToVideoPipeline` runs it: the image's latents are the first latent frame, which
    is never stepped, its tokens at timestep 0 while the others are at the step's."""

    def __init__(self, components: dict, device: torch.device, max_text_len: int, guidance: dict | None = None):
        from diffusers import LTX2Pipeline
        from diffusers.video_processor import VideoProcessor

        self.device, self.max_text_len = device, max_text_len
        self.transformers = [components["transformer"]]
        self.vae = components["vae"]
        self.scheduler = components["scheduler"]
        names = ("scheduler", "vae", "audio_vae", "text_encoder", "tokenizer", "connectors", "transformer", "vocoder")
        self.pipe = LTX2Pipeline(**{k: components[k] for k in names})
        self.pipe.set_progress_bar_config(disable=True)
        self.image_processor = VideoProcessor(
            vae_scale_factor=self.pipe.vae_spatial_compression_ratio, resample="bilinear"
        )
        self.guidance = {**GUIDANCE, **(guidance or {})}
        self.run: AudioRun | None = None
        # STG perturbs only blocks built with `perturbed_attn` (LTX-2.3's); on others (LTX-2.0's)
        # its forward is the conditional one again and its delta zero: that forward is not run.
        blocks = self.transformers[0].transformer_blocks
        self.stg_live = any(0 <= b < len(blocks) and blocks[b].perturbed_attn for b in self.guidance["stg_blocks"])

    def text_encoders(self) -> list:
        return [self.pipe.text_encoder, self.pipe.connectors]

    # -- inputs ------------------------------------------------------------------------------
    def cfg(self, guidance: float) -> bool:
        """Whether an unconditional branch runs (either stream's CFG scale above 1)."""
        return guidance > 1.0 or self.guidance["audio_guidance"] > 1.0

    @torch.no_grad()
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float):
        """The connectors' streams per branch; the connectors run on both prompts at once, as the
        pipeline runs them."""
        pipe = self.pipe
        with_uncond = self.cfg(guidance)
        embeds, mask, neg, neg_mask = pipe.encode_prompt(
            prompt=prompt,
            negative_prompt=negative_prompt,
            do_classifier_free_guidance=with_uncond,
            max_sequence_length=self.max_text_len,
            device=self.device,
        )
        if with_uncond:
            embeds, mask = torch.cat([neg, embeds]), torch.cat([neg_mask, mask])
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, connected = pipe.connectors(embeds, mask, padding_side=side)
        texts = [LTX2Text(v[None], a[None], m[None]) for v, a, m in zip(video, audio, connected, strict=True)]
        return TextEmbeds(texts[-1], texts[0] if with_uncond else None)

    def _latent_shape(self, height: int, width: int, frames: int) -> tuple[int, int, int]:
        pipe = self.pipe
        s, t = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
        return (frames - 1) // t + 1, height // s, width // s

    def _video_noise(self, generator, height: int, width: int, frames: int) -> torch.Tensor:
        channels = self.transformers[0].config.in_channels
        packed = self.pipe.prepare_latents(
            1, channels, height, width, frames, 0.0, torch.float32, self.device, generator
        )
        F, H, W = self._latent_shape(height, width, frames)
        cfg = self.transformers[0].config
        return self.pipe._unpack_latents(packed, F, H, W, cfg.patch_size, cfg.patch_size_t)

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] float32 noise, the pipeline's (it draws it packed; packing only orders it)."""
        return self._video_noise(torch.Generator("cpu").manual_seed(seed), height, width, frames)

    def audio_frames(self, frames: int, fps: float) -> int:
        """Audio latent frames of `frames` video frames at `fps`: the clip's seconds at the audio
        VAE's latent rate, as the pipeline rounds them."""
        pipe = self.pipe
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        return round(frames / fps * per_second)

    def condition(self, seed: int, height: int, width: int, frames: int, fps: float, image=None) -> LTX2Condition:
        """The item's audio noise, drawn from the item's generator after its video noise, and its
        image's latents (`encode_image`) when it has one."""
        generator = torch.Generator("cpu").manual_seed(seed)
        self._video_noise(generator, height, width, frames)
        pipe, length = self.pipe, self.audio_frames(frames, fps)
        mel_bins = pipe.audio_vae.config.mel_bins
        noise = pipe.prepare_audio_latents(
            1, pipe.audio_vae.config.latent_channels, length, mel_bins, 0.0, torch.float32, self.device, generator
        )
        return LTX2Condition(noise, length, mel_bins // pipe.audio_vae_mel_compression_ratio, float(fps), image)

    @torch.no_grad()
    def encode_image(self, image, latents_BCFHW, height: int, width: int, frames: int) -> torch.Tensor:
        """The first latent frame of an image-to-video item [1, C, 1, H, W] float32, as
        `LTX2ImageToVideoPipeline` makes it: the image re-compressed as one H.264 frame at the
        CRF its model was trained with (diffusers' function, through PyAV), resized to height x
        width, in the text encoder's dtype as the pipeline casts it, VAE-encoded (the mode),
        normalised by the VAE's latent statistics."""
        from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf, resolve_default_image_crf
        from PIL import Image

        pipe, vae = self.pipe, self.vae
        crf = resolve_default_image_crf(pipe.text_encoder)
        if crf != 0:
            image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
        pixels = self.image_processor.preprocess(image, height=height, width=width)
        pixels = pixels.to(self.device, pipe.text_encoder.dtype).to(vae.dtype)
        latents = vae.encode(pixels.unsqueeze(2)).latent_dist.mode().float()
        return pipe._normalize_latents(latents, vae.latents_mean, vae.latents_std)

    # -- the schedule ------------------------------------------------------------------------
    def new_scheduler(self, steps: int, sampler=None, latents_BCFHW: torch.Tensor | None = None):
        """The pipeline's sigmas (1 down to 1/steps), shifted by `mu` of the whole video's token
        count: every rank holds the whole latents, so no rank shifts by its shard's."""
        from runtime.models.schedulers import sampler_of

        if sampler is not None and sampler != sampler_of(self.scheduler):
            raise ConfigError("LTX-2's scheduler shifts by the video's size: --scheduler and --flow-shift do not apply")
        assert latents_BCFHW is not None, "LTX-2's shift depends on the video's token count"
        scheduler = type(self.scheduler).from_config(self.scheduler.config)
        scheduler.set_timesteps(
            sigmas=np.linspace(1.0, 1 / steps, steps), device=self.device, mu=self.mu(latents_BCFHW)
        )
        scheduler.set_begin_index(0)
        return scheduler

    def tokens(self, latents_BCFHW: torch.Tensor) -> int:
        cfg = self.transformers[0].config
        _, _, F, H, W = latents_BCFHW.shape
        return (F // cfg.patch_size_t) * (H // cfg.patch_size) * (W // cfg.patch_size)

    def mu(self, latents_BCFHW: torch.Tensor) -> float:
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

        get = self.scheduler.config.get
        return calculate_shift(
            self.tokens(latents_BCFHW),
            get("base_image_seq_len", 1024),
            get("max_image_seq_len", 4096),
            get("base_shift", 0.95),
            get("max_shift", 2.05),
        )

    def experts(self, timesteps: list[float], num_train_timesteps: int) -> list[int]:
        return [0] * len(timesteps)

    def begin_run(self, scheduler, condition: LTX2Condition) -> None:
        """The audio stream starts from the item's noise, with its own copy of the schedule."""
        self.run = AudioRun(
            condition.audio_noise.clone(), copy.deepcopy(scheduler), scheduler.sigmas, condition.image_BCFHW
        )

    def end_run(self, condition: LTX2Condition) -> torch.Tensor:
        """The denoised audio latents [1, C, L, M] float32, de-normalised (the pipeline's
        `output_type="latent"` audio)."""
        run, pipe = self.run, self.pipe
        self.run = None
        latents = pipe._denormalize_audio_latents(run.latents, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        return pipe._unpack_audio_latents(latents, condition.audio_frames, num_mel_bins=condition.mel_bins).float()

    def guidance_record(self, guidance: float, latents_BCFHW: torch.Tensor) -> dict:
        """What the report keeps of the guidance an item ran with."""
        terms = {k: list(v) if isinstance(v, tuple) else v for k, v in self.guidance.items()}
        return {
            "video": guidance,
            **terms,
            "stg_forward": self.stg_live,  # False: no STG block perturbs its attention, its delta is zero
            "shift_mu": round(self.mu(latents_BCFHW), 6),
            "tokens": self.tokens(latents_BCFHW),
        }

    # -- one step ----------------------------------------------------------------------------
    def forward(self, transformer, latents_BCFHW: torch.Tensor, t: torch.Tensor, text: LTX2Text, condition):
        """(video velocity [B, C, F, H, W], audio velocity [B, L, C*M]) of one forward in `text.mode`."""
        cfg, dtype = transformer.config, transformer.dtype
        _, _, F, H, W = latents_BCFHW.shape
        video = self.pipe._pack_latents(latents_BCFHW, cfg.patch_size, cfg.patch_size_t).to(dtype)
        audio = self.run.latents.to(dtype)
        rope = transformer.rope.prepare_video_coords(1, F, H, W, video.device, fps=condition.fps)
        audio_rope = transformer.audio_rope.prepare_audio_coords(1, condition.audio_frames, audio.device)
        timestep = t.expand(1)
        v, a = transformer(
            hidden_states=video,
            audio_hidden_states=audio,
            encoder_hidden_states=text.video,
            audio_encoder_hidden_states=text.audio,
            timestep=self.video_timestep(timestep, latents_BCFHW, condition),
            audio_timestep=timestep,
            sigma=timestep,
            encoder_attention_mask=text.mask,
            audio_encoder_attention_mask=text.mask,
            num_frames=F,
            height=H,
            width=W,
            fps=condition.fps,
            audio_num_frames=condition.audio_frames,
            video_coords=rope,
            audio_coords=audio_rope,
            isolate_modalities=text.mode == "isolated",
            spatio_temporal_guidance_blocks=list(self.guidance["stg_blocks"]) if text.mode == "stg" else None,
            perturbation_mask=None,
            use_cross_timestep=self.guidance["cross_timestep"],
            return_dict=False,
        )
        return self.pipe._unpack_latents(v.float(), F, H, W, cfg.patch_size, cfg.patch_size_t), a.float()

    def video_timestep(self, t: torch.Tensor, latents_BCFHW: torch.Tensor, condition: LTX2Condition) -> torch.Tensor:
        """The video tokens' timesteps: `t` [1], or with an image [1, N] per token, 0 on the
        first frame's (the pipeline's conditioning mask, packed as the tokens are)."""
        if condition.image_BCFHW is None:
            return t
        cfg = self.transformers[0].config
        B, _, F, H, W = latents_BCFHW.shape
        mask = torch.zeros(B, 1, F, H, W, dtype=torch.float32, device=latents_BCFHW.device)
        mask[:, :, 0] = 1.0
        packed = self.pipe._pack_latents(mask, cfg.patch_size, cfg.patch_size_t).squeeze(-1)
        return t.unsqueeze(-1) * (1 - packed)

    def guided_noise(self, den, step: int, t: torch.Tensor, latents: torch.Tensor, text: TextEmbeds, scale: float):
        """The step's video velocity under the pipeline's guidance; the audio stream steps here."""
        g, run = self.guidance, self.run
        sigma = run.sigmas[step]
        audio = run.latents
        latents = with_image(latents, run.image_BCFHW)

        def clean(sample, velocity):
            return sample - velocity * sigma

        den.begin_branch(0, "cond")
        v, a = den.predict(latents, t, text.cond_BLE)
        x_v, x_a = clean(latents, v), clean(audio, a)
        deltas_v, deltas_a = [], []
        if text.uncond_BLE is not None:
            den.begin_branch(1, "uncond")
            vu, au = den.predict(latents, t, text.uncond_BLE)
            deltas_v.append((scale - 1) * (x_v - clean(latents, vu)))
            deltas_a.append((g["audio_guidance"] - 1) * (x_a - clean(audio, au)))
        extra = (
            [("stg", g["stg"], g["audio_stg"], 0.0)] if self.stg_live and (g["stg"] > 0 or g["audio_stg"] > 0) else []
        )
        if g["modality"] > 1 or g["audio_modality"] > 1:
            extra.append(("isolated", g["modality"], g["audio_modality"], 1.0))
        for mode, video_scale, audio_scale, offset in extra:
            den.begin_branch(0, "cond")
            vp, ap = den.predict(latents, t, replace(text.cond_BLE, mode=mode))
            deltas_v.append((video_scale - offset) * (x_v - clean(latents, vp)))
            deltas_a.append((audio_scale - offset) * (x_a - clean(audio, ap)))
        guided_v, guided_a = x_v, x_a
        for d in deltas_v:
            guided_v = guided_v + d
        for d in deltas_a:
            guided_a = guided_a + d
        guided_v, guided_a = rescale(guided_v, x_v, g["rescale"]), rescale(guided_a, x_a, g["audio_rescale"])
        run.latents = run.scheduler.step((audio - guided_a) / sigma, t, audio, return_dict=False)[0]
        velocity = (latents - guided_v) / sigma
        if run.image_BCFHW is not None:  # the image's frame is not stepped (the loop's stays as it was)
            velocity[:, :, :1] = 0
        return velocity

    def final_latents(self, latents_BCFHW: torch.Tensor, condition) -> torch.Tensor:
        """The video latents (the image's in the first frame) de-normalised: the pipeline's
        `output_type="latent"` video."""
        vae = self.vae
        latents = with_image(latents_BCFHW, None if condition is None else condition.image_BCFHW)
        return self.pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)

    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        return latents_BCFHW.to(self.device, dtype=self.vae.dtype)

    def postprocess(self, video_BCFHW: torch.Tensor):
        return self.pipe.video_processor.postprocess_video(video_BCFHW, output_type="np")[0]

    @torch.no_grad()
    def decode_audio(self, audio_BCLM: torch.Tensor) -> tuple[np.ndarray, int]:
        """(waveform [channels, samples] float32, sample rate): the audio VAE's mel spectrogram
        through the vocoder, as the pipeline decodes it."""
        pipe = self.pipe
        mel = pipe.audio_vae.decode(audio_BCLM.to(self.device, pipe.audio_vae.dtype), return_dict=False)[0]
        wave = pipe.vocoder(mel)[0].float().cpu().numpy()
        return wave.reshape(-1, wave.shape[-1]), int(pipe.vocoder.config.output_sampling_rate)
