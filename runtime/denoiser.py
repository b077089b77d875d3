"""The denoising loop: one loop for every model family, over diffusers' components.

Later strategies need to control every CFG branch and every step, so the loop is written out
here instead of calling the diffusers pipeline's `__call__`. With the family's model
(runtime/models/<family>/loop.py: text encoding, initial latents, scheduler, the
transformer's inputs, the VAE's) it reproduces that call exactly; tests/test_parity.py holds
it to <= 1e-5 in float32.

What runs beside the loop is attached by runtime/assembly.py: the strategy installed on the
transformers, a `LoopListener` told where the loop is (DiTango's runtime), the CFG runner
(`guidance`) and a step cache.

Shape legend: B batch, C latent channels, F latent frames, H/W latent height/width.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np
import torch

from runtime.guidance import CfgParallel, SequentialCfg
from runtime.loop_types import DenoiseResult, ImageCondition, TextEmbeds
from runtime.models.families import family_of
from runtime.models.loading import Placement
from runtime.models.schedulers import Sampler
from runtime.profiling import step_region
from runtime.step_cache import StepCache
from runtime.vae import DecodeOptions, decode_video


class LoopListener(Protocol):
    """Told where the loop is: the run (its latents, steps, CFG branches on this rank and the
    steps where another expert takes over), each step and each CFG branch evaluation."""

    def begin_run(self, latents_BCFHW: torch.Tensor, steps: int, branches: int, switches: tuple[int, ...]) -> None: ...
    def begin_step(self, step: int) -> None: ...
    def begin_branch(self, branch: int) -> None: ...
    def end_step(self, step: int) -> None: ...
    def end_run(self) -> None: ...


def host_timesteps(scheduler) -> list[float]:
    """The scheduler's timesteps as host numbers (one copy from the device)."""
    return scheduler.timesteps.tolist()


def switch_steps(experts: list[int]) -> tuple[int, ...]:
    return tuple(i for i in range(1, len(experts)) if experts[i] != experts[i - 1])


def synchronize(device: torch.device) -> None:
    """Make wall-clock timings honest on asynchronous devices."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Denoiser:
    """Text (and image) encoding, initial latents, the denoising loop and VAE decoding of one
    loaded model. `options` go to the family's `load_model` (Wan: `variant`; HunyuanVideo:
    `prompt_template`). Built bare (exact, one device); runtime/assembly.py's `build_denoiser`
    installs what a run asks for."""

    def __init__(self, components: dict, placement: Placement, max_text_len: int, variant=None, **options):
        self.placement = placement
        self.family = family_of(components["transformer"])
        self.model = self.family.load_model(components, placement.device, max_text_len, variant, **options)
        self.transformers = self.model.transformers
        self.vae = self.model.vae
        self.expert = 0  # the expert of the step being run
        self.branch_name = "cond"
        self.listener: LoopListener | None = None  # DiTango's runtime, under --parallel ditango
        self.guidance: SequentialCfg | CfgParallel = SequentialCfg()  # how the CFG branches run (runtime/guidance.py)
        self.step_cache: StepCache | None = None  # --step-cache (runtime/step_cache.py)
        self.parallel = None  # the installed strategy (runtime/strategies/parallelize.py), to undo or run exact
        self.quantized = None  # --quantize's layers (runtime/quantize.py): exact() runs their originals, if kept
        self._condition: ImageCondition | None = None  # the image condition of the run in progress

    @property
    def device(self) -> torch.device:
        return self.placement.device

    @property
    def transformer(self):
        """The expert of the current step (the only one outside a two-expert run)."""
        return self.transformers[self.expert]

    @property
    def ditango(self):
        """DiTango's runtime (runtime/strategies/selective.py) when installed, else None."""
        return None if self.parallel is None else self.parallel.ditango

    # -- inputs ------------------------------------------------------------------------------
    def encode_text(self, prompt: str, negative_prompt: str | None, guidance: float, embedded: float | None = None):
        """The item's text per CFG branch (`TextEmbeds`); `embedded`: a distilled guidance scale,
        passed only when given, to the families that take one (HunyuanVideo's `guidance_scale`)."""
        options = {} if embedded is None else {"embedded": embedded}
        return self.model.encode_text(prompt, negative_prompt, guidance, **options)

    def text_encoders(self) -> list:
        return self.model.text_encoders()

    def initial_latents(self, seed: int, height: int, width: int, frames: int) -> torch.Tensor:
        """[1, C, F, H, W] float32 noise, identical to diffusers' pipeline with a CPU generator seeded `seed`."""
        return self.model.initial_latents(seed, height, width, frames)

    def encode_image(self, image, latents_BCFHW: torch.Tensor, height: int, width: int, frames: int) -> ImageCondition:
        return self.model.encode_image(image, latents_BCFHW, height, width, frames)

    def new_scheduler(self, steps: int, sampler: Sampler | None = None, latents_BCFHW: torch.Tensor | None = None):
        """A fresh scheduler (multistep solvers keep per-run state) with its timesteps set:
        the model's own, or `sampler`'s solver and shift (`latents_BCFHW`: the run's, for a
        schedule shifted by the video's size)."""
        return self.model.new_scheduler(steps, sampler, latents_BCFHW)

    def experts(self, scheduler) -> list[int]:
        """Per step, the expert that runs it; read from the host copy of the timesteps once per
        run (a comparison on the device would wait for it every step)."""
        return self.model.experts(host_timesteps(scheduler), scheduler.config.num_train_timesteps)

    def switches(self, scheduler) -> tuple[int, ...]:
        """Steps where the expert changes (none for one expert)."""
        return switch_steps(self.experts(scheduler))

    # -- one evaluation ----------------------------------------------------------------------
    def begin_branch(self, branch: int, name: str = "cond") -> None:
        """The next evaluation is CFG branch `branch` of this rank ("cond" or "uncond")."""
        self.branch_name = name
        if self.listener is not None:
            self.listener.begin_branch(branch)

    def predict(self, latents_BCFHW: torch.Tensor, t: torch.Tensor, text) -> torch.Tensor:
        """One transformer evaluation (one CFG branch) by the current expert; `text`: that
        branch's entry of `TextEmbeds`."""
        cache = (
            contextlib.nullcontext()
            if self.step_cache is None
            else self.step_cache.forward(self.transformer, self.branch_name)
        )
        with cache:
            return self.model.forward(self.transformer, latents_BCFHW, t, text, self._condition)

    # -- the loop ----------------------------------------------------------------------------
    @torch.no_grad()
    def denoise(
        self,
        latents_BCFHW: torch.Tensor,
        text: TextEmbeds,
        steps: int,
        guidance: float,
        on_step: Callable[[int, int], None] | None = None,
        condition: ImageCondition | None = None,
        guidance_2: float | None = None,
        run_steps: frozenset[int] | None = None,
        sampler: Sampler | None = None,
        trace: list | None = None,
    ) -> DenoiseResult:
        """`guidance_2`: the low-noise expert's CFG scale (default `guidance`, as diffusers);
        `run_steps`: only these steps of the schedule run (a rehearsal's sample), None: all;
        `sampler`: the solver and flow shift (None: the model's own scheduler); `trace`: gets a
        float32 host copy of the latents after every step (--reference exact's per-step error)."""
        scheduler = self.new_scheduler(steps, sampler, latents_BCFHW)
        result = DenoiseResult(latents_BCFHW)
        streams = getattr(self.model, "begin_run", None)  # a model with a stream of its own (LTX-2's audio)
        if streams is not None:
            streams(scheduler, condition)
        latents = latents_BCFHW
        listener, cache = self.listener, self.step_cache
        self._condition = condition
        experts = self.experts(scheduler)
        if listener is not None:
            listener.begin_run(latents, steps, self.guidance.local_branches(text), switch_steps(experts))
        self.guidance.begin_run(steps)
        finite: list[torch.Tensor] = []  # per step, on the device: no host sync inside the loop
        try:
            if cache is not None:
                cache.begin_run(self.transformers, self.family, steps)
            for i, t in enumerate(scheduler.timesteps):
                if run_steps is not None and i not in run_steps:
                    continue
                start = time.perf_counter()
                self.expert = experts[i]
                scale = guidance if self.expert == 0 or guidance_2 is None else guidance_2
                with step_region(i):
                    if listener is not None:
                        listener.begin_step(i)
                    if cache is not None:
                        cache.begin_step(i, t)
                    noise = self.guidance.noise(self, i, t, latents, text, scale)
                    latents = scheduler.step(noise, t, latents, return_dict=False)[0]
                    if trace is not None:
                        trace.append(latents.detach().float().cpu())
                    finite.append(torch.isfinite(latents).all())
                    if listener is not None:
                        listener.end_step(i)
                synchronize(self.device)
                result.step_s.append(time.perf_counter() - start)
                if on_step is not None:
                    on_step(i + 1, steps)
        finally:  # a failed item frees its buffers too: a retry's automatic cache cap reads free memory
            self.expert, self._condition = 0, None
            try:
                if listener is not None:
                    listener.end_run()
            finally:
                if cache is not None:
                    cache.end_run()
        result.latents_BCFHW = self.model.final_latents(latents, condition)
        if streams is not None:
            result.audio_BCLM = self.model.end_run(condition)
        flags = torch.stack(finite).tolist() if finite else []
        result.first_nonfinite_step = next((i + 1 for i, ok in enumerate(flags) if not ok), None)
        return result

    @contextlib.contextmanager
    def exact(self):
        """Runs inside are exact: DiTango's reuse off (the ring over the cp group instead), a
        skipping step cache off (one calibrating stays on: it never skips), and a quantized
        model's unquantized layers where it kept them (--reference exact)."""
        listener, cache = self.listener, self.step_cache
        self.listener = None
        if cache is not None and not cache.calibrating:
            self.step_cache = None
        try:
            with contextlib.ExitStack() as stack:
                if self.parallel is not None:
                    stack.enter_context(self.parallel.exact())
                if self.quantized is not None and self.quantized.kept:
                    stack.enter_context(self.quantized.original())
                yield self
        finally:
            self.listener, self.step_cache = listener, cache

    # -- the decode --------------------------------------------------------------------------
    def vae_input(self, latents_BCFHW: torch.Tensor) -> torch.Tensor:
        """The denoised latents as the VAE takes them (the family's de-normalisation)."""
        return self.model.vae_input(latents_BCFHW)

    def decode(self, latents_BCFHW: torch.Tensor) -> np.ndarray:
        """Latents -> uint8 frames [F, H, W, 3] (first batch entry), as the diffusers pipeline
        decodes them (one process, untiled)."""
        return self.decode_with(latents_BCFHW, DecodeOptions())[0]

    @torch.no_grad()
    def decode_with(
        self, latents_BCFHW: torch.Tensor, options: DecodeOptions, ctx=None
    ) -> tuple[np.ndarray | None, dict]:
        """(uint8 frames [F, H, W, 3] on the writer, None elsewhere; the decode's record):
        tiled and spread over `ctx`'s ranks as `options` say (runtime/vae.py)."""
        decoded = decode_video(self.vae, self.vae_input(latents_BCFHW), options, ctx)
        if decoded.video_BCFHW is None:
            return None, decoded.record
        frames = self.model.postprocess(decoded.video_BCFHW)
        return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8), decoded.record
