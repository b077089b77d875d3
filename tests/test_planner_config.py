"""DiTango planner configuration: validation, defaults, sizes, expert switches (no processes)."""

from __future__ import annotations

import pytest
import torch

from basics.errors import ConfigError
from planner.ditango import DiTangoPlanner, PlannerConfig

# --- config ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "bad"),
    [
        ({"cache_ratio": 1.0}, "1.0"),
        ({"cache_ratio": -0.25}, "-0.25"),
        ({"cache_ratio": float("nan")}, "nan"),
        ({"warmup": -1}, "-1"),
        ({"cooldown": -3}, "-3"),
        ({"gate_factor": 0.0}, "0.0"),
        ({"tau_max": 0}, "tau_max=0"),
        ({"anchor_interval": -2}, "-2"),
        ({"planner": "greedy"}, "greedy"),
        ({"own_group": "never"}, "never"),
        ({"front_load": 2.5}, "2.5"),
        ({"warmup": 2.5}, "2.5"),
    ],
)
def test_config_validation(kwargs, bad):
    with pytest.raises(ConfigError) as err:
        PlannerConfig(**kwargs)
    assert isinstance(err.value, ValueError)
    assert bad in str(err.value) and "legal" in str(err.value)


def test_config_defaults_and_planner_sizes():
    cfg = PlannerConfig()
    assert (cfg.cache_ratio, cfg.warmup, cfg.cooldown, cfg.gate_factor) == (0.5, 5, 5, 0.6)
    assert cfg.tau_max is None and cfg.anchor_interval is None and cfg.use_alpha is False
    with pytest.raises(ConfigError, match="layers=0"):
        DiTangoPlanner(cfg, steps=10, layers=0, units=2)


def test_an_expert_switch_is_an_anchor():
    """Wan2.2's second expert takes over at step 5: nothing the first expert cached is reused
    there (anchor), and the window after it plans from the new anchor; without the switch the
    same observations give a selective step 5."""
    from planner.ditango import DiTangoPlanner, PlannerConfig

    def kinds(switches):
        p = DiTangoPlanner(PlannerConfig(cache_ratio=0.5, warmup=1, cooldown=1), 9, 2, 3, switches)
        out = []
        for step in range(9):
            plan = p.plan(step)
            out.append(plan.kind)
            if plan.kind == "selective":
                ase = torch.arange(6, dtype=torch.float32).reshape(2, 3) + step
                p.observe(step, ase, gate=0.0)
        return out

    assert kinds(())[5] == "selective"
    with_switch = kinds((5,))
    assert with_switch[5] == "anchor" and with_switch[6] == "selective"
    assert with_switch[:5] == kinds(())[:5]
    assert kinds((0, 9)) == kinds(())  # steps outside the run are no switches
