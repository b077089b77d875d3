"""Launch a RunConfig on the ranks its layout asks for.

A single-process layout runs in this process. Multi-rank layouts (local process groups,
Slurm jobs through submitit) are added here; the CLI only ever calls `launch`.
"""

from __future__ import annotations

from runtime.config import RunConfig
from runtime.errors import ConfigError
from runtime.run import Observer, execute


def launch(cfg: RunConfig, observer: Observer | None = None) -> dict:
    """Run `cfg` and return its report (the same dict that is written to report.json)."""
    if cfg.layout.world_size != 1:
        raise ConfigError(f"world size {cfg.layout.world_size} is not supported yet: run on one process")
    return execute(cfg, observer)
