"""The launchers: where a run's ranks come from, one module each.

- local.py: local processes, one per rank (processes.py spawns and watches them);
- srun.py: srun steps inside a Slurm allocation (salloc, or an sbatch script of your own);
- sbatch.py: jobs submitted with sbatch through submitit;
- env.py: this process as a rank another launcher started (torchrun, Kubernetes, MPI): no
  supervisor of ours, the launcher's.

The CLI picks `where` (slurm/options.py `choose_executor`); `executor_for` gives the executor
the supervisor (slurm/supervise.py) drives: `launch(tasks, decided)` and `report()`.
"""

from __future__ import annotations

from collections.abc import Callable

from runtime.config import RunConfig
from runtime.outputs import progress_line
from slurm.options import SlurmOptions


def executor_for(cfg: RunConfig, opts: SlurmOptions, where: str, wait: bool, observer, say: Callable[[str], None]):
    """The executor of `where`; `observer` draws local progress, `say` prints Slurm's (a line
    when the job states or the item counts change)."""
    if where == "local":
        from slurm.launchers.local import LocalExecutor

        return LocalExecutor(cfg, opts.array, observer)
    last: list[str | None] = [None]

    def show(states: list[str]) -> None:
        line = progress_line(cfg, states)
        if line != last[0]:
            say(line)
            last[0] = line

    if where == "srun":
        from slurm.launchers.srun import SrunExecutor

        return SrunExecutor(cfg, opts, show, say)
    from slurm.launchers.sbatch import SbatchExecutor

    return SbatchExecutor(cfg, opts, wait, show, say)
