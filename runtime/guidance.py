"""Classifier-free guidance execution: both branches on one rank group (sequential),
one branch per rank group (CFG-parallel), and Hybridiff's switch to a two-segment
pipeline in the middle steps (docs/ALGORITHMS.md section 3).

Shape legend: B batch, C latent channels, F/H/W latent frames/height/width, S local
tokens, X hidden width.

Rank groups: cfg index 0 runs the unconditional branch, cfg index 1 the conditional
one, both on the same x_t. Predictions are exchanged between CFG partners (same cp
index), and the guidance combine and the scheduler step run identically on both, so
no latent broadcast is needed.

Hybridiff's pipeline stage cuts the transformer at block `split`: the cfg-0 group runs
segment A (blocks [0, split)) on the current x_t and sends the boundary activations;
the cfg-1 group runs segment B (blocks [split, L) and the output head) on the boundary
activations of the PREVIOUS step (one step stale, AsyncDiff style) with the current
timestep and the conditional text, and sends the prediction back. Only segment B's
output is used: guidance is off in that window. The first pipeline step ("fill") runs
both segments on the cfg-1 group (A, then B on that same step's boundary), which keeps
the boundary for the next step. Segment A's cross-attention uses `first_segment_text`: "cond" (default, the
clean variant) or "uncond" (the authors' released code).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from planner.hybrid import HybridConfig, HybridSchedule
from runtime.comm import Comm
from runtime.mesh import Mesh
from runtime.models.families import family_of


class BlockCounter:
    """Counts transformer block evaluations (forward pre-hooks), per step, over all experts."""

    def __init__(self, transformers, adapter) -> None:
        self.count = 0
        self.per_step: list[int] = []
        blocks = [b for tr in transformers for b in adapter.segment_blocks(tr)]
        self.handles = [b.register_forward_pre_hook(self._hook) for b in blocks]

    def _hook(self, module, args) -> None:
        self.count += 1

    def end_step(self) -> None:
        self.per_step.append(self.count)
        self.count = 0

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class SequentialCfg:
    """Both branches on this rank: cond then uncond, exactly as diffusers' WanPipeline."""

    def local_branches(self, text) -> int:
        return 1 if text.uncond_BLE is None else 2

    def begin_run(self, steps: int) -> None: ...

    def noise(self, den, step: int, t, latents, text, guidance: float) -> torch.Tensor:
        own = getattr(den.model, "guided_noise", None)  # a family whose pipeline guides its own way (LTX-2)
        if own is not None:
            return own(den, step, t, latents, text, guidance)
        den.begin_branch(0, "cond")
        noise = den.predict(latents, t, text.cond_BLE)
        if text.uncond_BLE is not None:
            den.begin_branch(1, "uncond")
            noise_uncond = den.predict(latents, t, text.uncond_BLE)
            noise = noise_uncond + guidance * (noise - noise_uncond)
        return noise

    def record(self) -> dict | None:
        return None


class CfgParallel:
    """One branch per cfg rank group; predictions exchanged with the CFG partner."""

    def __init__(self, mesh: Mesh, comm: Comm) -> None:
        assert mesh.layout.cfg_degree == 2
        self.mesh, self.comm = mesh, comm
        self.partner = next(r for r in mesh.cfg_ranks if r != mesh.rank)
        self.uncond_side = mesh.cfg_index == 0

    def local_branches(self, text) -> int:
        return 1

    def begin_run(self, steps: int) -> None: ...

    def predictions(self, den, t, latents, text, purpose: str = "cfg") -> tuple[torch.Tensor, torch.Tensor]:
        """(eps_uncond, eps_cond) on both partners."""
        assert text.uncond_BLE is not None, "CFG-parallel needs guidance > 1"
        den.begin_branch(0, "uncond" if self.uncond_side else "cond")
        mine = den.predict(latents, t, text.uncond_BLE if self.uncond_side else text.cond_BLE)
        other = self.exchange(mine, mine.shape, purpose)
        return (mine, other) if self.uncond_side else (other, mine)

    def exchange(self, send: torch.Tensor, recv_shape, purpose: str) -> torch.Tensor:
        return self.comm.exchange(
            send,
            dst=self.partner,
            src=self.partner,
            recv_shape=recv_shape,
            group=self.mesh.cfg_group,
            purpose=purpose,
        ).wait()

    def noise(self, den, step: int, t, latents, text, guidance: float) -> torch.Tensor:
        eps_u, eps_c = self.predictions(den, t, latents, text)
        return eps_u + guidance * (eps_c - eps_u)

    def record(self) -> dict | None:
        return None


class _Boundary(Exception):
    """Raised by a hook to end segment A's forward at the cut (nothing after it runs)."""

    def __init__(self, hidden: torch.Tensor) -> None:
        self.hidden = hidden


class Hybrid(CfgParallel):
    """Hybridiff: CFG-parallel, a k-step two-segment pipeline after tau1, CFG-parallel again.

    With two experts (Wan2.2 A14B) the monitor runs unchanged over the whole run (M of
    whichever expert ran the step), but a boundary never crosses the switch: segment A's
    activations of one expert are no input of the other's segment B, so a pipeline step that
    is the first of a new expert runs as a fill (both segments of the new expert on the cfg-1
    group), recorded as "pipeline-fill" in the stages."""

    def __init__(self, mesh: Mesh, comm: Comm, cfg: HybridConfig, transformers) -> None:
        super().__init__(mesh, comm)
        self.cfg = cfg
        transformers = list(transformers) if isinstance(transformers, (list, tuple)) else [transformers]
        self.adapter = family_of(transformers[0])
        self.split = cfg.split_for(len(self.adapter.segment_blocks(transformers[0])))
        self.counter = BlockCounter(transformers, self.adapter)
        self.schedule: HybridSchedule | None = None
        self.boundary: torch.Tensor | None = None  # cfg-1 side: segment A's output of the previous step
        self.boundary_expert: int | None = None  # the expert whose segment A made `boundary`
        self.stage_bytes: dict[str, int] = defaultdict(int)

    def begin_run(self, steps: int) -> None:
        self.schedule = HybridSchedule(self.cfg, steps)
        self.boundary = self.boundary_expert = None
        self.counter.per_step.clear()
        self.counter.count = 0
        self.stage_bytes = defaultdict(int)

    def _bytes(self) -> int:
        totals = self.comm.totals()
        return totals["intra_node_bytes"] + totals["inter_node_bytes"]

    def noise(self, den, step: int, t, latents, text, guidance: float) -> torch.Tensor:
        assert self.schedule is not None, "begin_run first"
        stage = self.schedule.begin(step)
        if stage == "pipeline" and den.expert != self.boundary_expert:
            # the first pipeline step of another expert: no stale boundary crosses the switch
            stage = self.schedule.stages[-1] = "pipeline-fill"
        before = self._bytes()
        if stage == "cfg-parallel":
            eps_u, eps_c = self.predictions(den, t, latents, text)
            # float32 (a float64 copy of both predictions ran at 1/64 speed on most GPUs)
            m = (eps_c.float() - eps_u.float()).abs().mean() / eps_u.float().abs().mean()
            undecided = self.schedule.tau1 is None
            self.schedule.observe(step, float(m))
            if undecided and self.mesh.world_group is not None:
                # Every rank saw the same M, but a stage mismatch would pair different exchanges:
                # rank 0's decision is the one everybody follows.
                self.schedule.tau1 = self.comm.broadcast_object(self.schedule.tau1, 0, self.mesh.world_group)
            out = eps_u + guidance * (eps_c - eps_u)
        else:
            out = self._pipeline_step(den, stage, t, latents, text)
            self.schedule.observe(step, None)
        self.stage_bytes[stage] += self._bytes() - before
        self.counter.end_step()
        return out

    # -- segments ------------------------------------------------------------------------
    def _first_text(self, text) -> torch.Tensor:
        return text.cond_BLE if self.cfg.first_segment_text == "cond" else text.uncond_BLE

    def _segment_a(self, den, t, latents, text) -> torch.Tensor:
        """Blocks [0, split) on the current latents; returns the boundary activations (this
        rank's token chunk). The forward is stopped at the cut: nothing after it runs."""

        def stop(module, args, output):
            raise _Boundary(output)

        cut = self.adapter.segment_blocks(den.transformer)[self.split - 1]
        handle = cut.register_forward_hook(stop)
        try:
            den.predict(latents, t, self._first_text(text))
        except _Boundary as b:
            return self.adapter.pack_boundary(b.hidden)
        finally:
            handle.remove()
        raise AssertionError("segment A did not reach the cut")

    def _segment_b(self, den, t, latents, text, boundary: torch.Tensor) -> torch.Tensor:
        """Blocks [split, L) and the head on `boundary`, conditional text, timestep t."""
        with self.adapter.from_block(den.transformer, self.split, boundary):
            return den.predict(latents, t, text.cond_BLE)

    def _pipeline_step(self, den, stage: str, t, latents, text) -> torch.Tensor:
        den.begin_branch(0)
        eps_dtype = den.transformer.dtype  # the model's output dtype (bf16 on GPU)
        self.boundary_expert = den.expert  # both partners: the boundary kept or sent now is this expert's
        if self.uncond_side:
            if stage == "pipeline-fill":  # the partner runs both segments; we receive its prediction
                return self.comm.one_way(
                    None,
                    self.partner,
                    self.mesh.rank,
                    latents.shape,
                    eps_dtype,
                    latents.device,
                    self.mesh.cfg_group,
                    "pipeline",
                )
            boundary = self._segment_a(den, t, latents, text)
            return self.exchange(boundary, latents.shape, "pipeline")  # boundary out, prediction in
        if stage == "pipeline-fill":  # whole model here: A then B on the same step's boundary
            self.boundary = self._segment_a(den, t, latents, text)
            eps = self._segment_b(den, t, latents, text, self.boundary)
            self.comm.one_way(eps, self.mesh.rank, self.partner, None, None, None, self.mesh.cfg_group, "pipeline")
            return eps
        assert self.boundary is not None, "pipeline step without a filled boundary"
        eps = self._segment_b(den, t, latents, text, self.boundary)  # previous step's boundary: one step stale
        self.boundary = self.exchange(eps, self.boundary.shape, "pipeline")
        return eps

    def record(self) -> dict:
        assert self.schedule is not None
        return {
            **self.schedule.to_json(),
            "split": self.split,
            "block_evals": list(self.counter.per_step),
            "bytes_per_stage": dict(self.stage_bytes),
        }
