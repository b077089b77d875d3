"""Hybridiff's tau1 detection on synthetic monitor curves, and its defaults."""

from __future__ import annotations

import math
import random

import pytest

from basics.errors import ConfigError
from planner.hybrid import HybridConfig, HybridSchedule, detect_tau1, scaled_defaults


def u_shape(n: int, bottom: int) -> list[float]:
    return [0.5 * ((i - bottom) / n) ** 2 + 0.01 for i in range(n)]


def test_u_shape_switches_near_the_bottom():
    m = u_shape(50, bottom=20)
    tau1 = detect_tau1(m, window=5, slope=1e-3, tau_cap=40)
    assert tau1 is not None and 14 <= tau1 <= 22  # where the descent flattens out
    # Before tau1 the window slope was still steep (>= threshold) or the window not full.
    for i in range(5, tau1):  # the rule is evaluated from i = L on
        assert not 0 <= (m[i - 4] - m[i]) / 5 < 1e-3


def test_rising_curve_is_not_a_plateau():
    m = [0.1 + 0.01 * i for i in range(30)]  # slope negative: G < 0 never qualifies
    assert detect_tau1(m, window=5, slope=1e-3, tau_cap=25) == 25


def test_flat_curve_switches_as_soon_as_the_rule_applies():
    assert detect_tau1([0.2] * 30, window=6, slope=1e-4, tau_cap=25) == 6  # first i >= L


def test_noisy_plateau():
    """Noise on the plateau is as large as the threshold: rising windows (G < 0) must not
    count, and the switch still comes on the plateau, not during the descent."""
    rng = random.Random(0)
    m = [1.0 - 0.04 * i for i in range(20)] + [0.2 + rng.uniform(-4e-3, 4e-3) for _ in range(30)]
    tau1 = detect_tau1(m, window=4, slope=1e-3, tau_cap=45)
    assert 20 <= tau1 < 45
    g = (m[tau1 - 3] - m[tau1]) / 4
    assert 0 <= g < 1e-3


def test_never_converging_hits_the_cap():
    m = [1.0 - 0.02 * i for i in range(50)]  # steady descent of 0.02 per step
    assert detect_tau1(m, window=5, slope=1e-3, tau_cap=30) == 30
    assert detect_tau1(m[:10], window=5, slope=1e-3, tau_cap=30) is None  # undecided yet


def test_schedule_stages_and_k0():
    sched = HybridSchedule(HybridConfig(k=3, window=2, slope=1.0, tau_cap=10), steps=12)
    stages = []
    for step in range(12):
        stages.append(sched.begin(step))
        sched.observe(step, None if stages[-1] != "cfg-parallel" else 0.5)
    assert sched.tau1 == 2 and sched.tau2 == 5
    assert stages[:7] == ["cfg-parallel"] * 3 + ["pipeline-fill", "pipeline", "pipeline", "cfg-parallel"]
    plain = HybridSchedule(HybridConfig(k=0, window=2, slope=1.0, tau_cap=10), steps=5)
    assert [plain.begin(i) or plain.observe(i, 0.5) or plain.stages[-1] for i in range(5)] == ["cfg-parallel"] * 5


def test_defaults_scale_with_steps():
    assert scaled_defaults(50) == {"k": 5, "window": 15, "slope": 5e-4, "tau_cap": 40}
    d = scaled_defaults(20)
    assert (d["k"], d["window"], d["tau_cap"]) == (2, 6, 16) and math.isclose(d["slope"], 1.25e-3)
    cfg = HybridConfig(k=7).resolved(20)
    assert cfg.k == 7 and cfg.window == 6


@pytest.mark.parametrize("kwargs", [{"k": -1}, {"window": 1}, {"slope": 0.0}, {"tau_cap": -2}])
def test_config_validation(kwargs):
    with pytest.raises(ConfigError):
        HybridConfig(**kwargs)
    with pytest.raises(ConfigError, match="--hybrid-split"):
        HybridConfig(split=4).split_for(4)


def test_tau2_is_clipped_to_the_run():
    sched = HybridSchedule(HybridConfig(k=10, window=2, slope=1.0, tau_cap=3), steps=6)
    for step in range(6):
        sched.observe(step, None if sched.begin(step) != "cfg-parallel" else 0.5)
    assert sched.tau1 == 2 and sched.tau2 == 5 and sched.stages[-1] == "pipeline"
