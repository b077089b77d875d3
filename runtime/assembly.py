"""One place where a rank's denoiser is put together: the family's model, the attention
strategy installed on its transformers, the step cache and the CFG runner. Read top to
bottom, this is what a run (and every test) gets.
"""

from __future__ import annotations

from planner.ditango import DiTangoOptions
from planner.hybrid import HybridConfig
from planner.strategy import Strategy
from runtime.comm import Comm
from runtime.denoiser import Denoiser
from runtime.guidance import CfgParallel, Hybrid
from runtime.kernels import use_on_one_rank
from runtime.mesh import Mesh
from runtime.models.loading import Placement
from runtime.step_cache import StepCache
from runtime.step_cache_options import StepCacheSpec
from runtime.strategies import parallelize
from runtime.weights import SHARDED, move_unsplit

TP_SPLIT = ("transformer", "transformer_2")


def host_loaded(strategy: Strategy, shard_weights: bool, distributed: bool, quantize: str = "none") -> tuple[str, ...]:
    """Components loaded onto the CPU first, so that no GPU ever holds them whole: those
    --shard-weights shards (runtime/weights.py moves the shards), the transformers tensor
    parallelism splits (each rank's slices go to its GPU as they are cut; the rest follows),
    and the transformers --quantize converts (each layer goes to the GPU as it is quantized:
    runtime/quantize.py)."""
    loaded: tuple[str, ...] = ()
    if distributed and shard_weights:
        loaded = SHARDED
    elif distributed and strategy.splits_weights:
        loaded = TP_SPLIT
    if quantize != "none":
        loaded = tuple(dict.fromkeys((*loaded, *TP_SPLIT)))
    return loaded


def build_denoiser(
    components: dict,
    placement: Placement,
    max_text_len: int,
    *,
    variant=None,
    mesh: Mesh | None = None,
    comm: Comm | None = None,
    backend: str = "sdpa",
    ditango: DiTangoOptions | None = None,
    step_cache: StepCacheSpec | None = None,
    hybrid: HybridConfig | None = None,
    split_on_host: bool = False,
    **options,
) -> Denoiser:
    """The denoiser of loaded `components` on this rank of `mesh` (None: one process, exact).

    - the family's model and loop (`variant`, `options`: runtime/denoiser.py);
    - the layout's strategy on every transformer (experts share it); under --parallel ditango
      its runtime listens to the loop; one rank a branch keeps diffusers' attention, running
      the kernel `backend` (runtime/kernels.py `use_on_one_rank`);
    - `split_on_host`: the transformers were loaded on the CPU for tensor parallelism to split
      or --quantize to convert: what stays whole (norms, embeddings, head) then follows the
      slices or the quantized layers to the device;
    - the step cache, whose skip decisions the ranks of one branch agree (and which DiTango's
      plan then follows layer by layer);
    - the CFG runner: Hybridiff's, or the branches on two rank groups, or both here."""
    denoiser = Denoiser(components, placement, max_text_len, variant, **options)
    if mesh is None or mesh.layout.strategy.runtime is None:  # one rank a branch: diffusers' attention
        use_on_one_rank(denoiser.transformers, backend)
    if mesh is None:
        return denoiser
    if mesh.layout.strategy.runtime is not None:
        denoiser.parallel = parallelize(denoiser.transformers, mesh, comm, backend, ditango)
        denoiser.listener = denoiser.parallel.ditango
    if split_on_host:
        for transformer in denoiser.transformers:
            move_unsplit(transformer, placement.device)
    if step_cache is not None:
        denoiser.step_cache = StepCache(step_cache, comm, mesh.cp_group, tuple(mesh.cp_ranks))
        if denoiser.ditango is not None:
            denoiser.ditango.partial_steps = True
    if hybrid is not None:
        denoiser.guidance = Hybrid(mesh, comm, hybrid, denoiser.transformers)
    elif mesh.layout.cfg_degree == 2:
        denoiser.guidance = CfgParallel(mesh, comm)
    return denoiser
