"""--target-psnr: the cache ratio chosen by bisection on the first item, used for every item,
recorded, and kept for a relaunch of the same command."""

from __future__ import annotations

import json

import pytest

from ditango_cli.app import app

TARGET = 33.0


def _run(runner, prompts, out, *extra):
    args = [
        "generate",
        "--prompts",
        str(prompts),
        "--out",
        str(out),
        "--device",
        "cpu",
        "--steps",
        "8",
        "--height",
        "32",
        "--width",
        "32",
        "--frames",
        "9",
        "--gpus",
        "2",
        "--nodes",
        "2",
        "--executor",
        "local",
        "--parallel",
        "ditango",
        "--group-size",
        "1",
        "--warmup",
        "1",
        "--cooldown",
        "1",
        "--target-psnr",
        str(TARGET),
        "--reference",
        "exact",
        "--reuse",
        "always",
        *extra,
    ]
    return runner.invoke(app, args)


@pytest.mark.distributed
@pytest.mark.e2e
def test_target_psnr_chooses_records_and_keeps_the_ratio(runner, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle moving left on a black background\na blue square moving up on a gray background\n")
    out = tmp_path / "out"
    result = _run(runner, prompts, out)
    assert result.exit_code == 0, result.stderr
    report = json.loads((out / "report.json").read_text())
    cal = report["calibration"]
    trials = cal["trials"]
    assert cal["target_psnr"] == TARGET and len(trials) == 5 and cal["planner"] == "hpdc"
    # bisection: each trial is the midpoint of the bracket the earlier verdicts left
    lo, hi = 0.0, 0.95
    for t in trials:
        assert t["cache_ratio"] == round((lo + hi) / 2, 4)
        reached = t["psnr"] is None or t["psnr"] >= TARGET
        lo, hi = (t["cache_ratio"], hi) if reached else (lo, t["cache_ratio"])
    assert cal["cache_ratio"] == lo
    first, second = report["items"]
    assert first["id"] == cal["item"]
    assert all(i["attention"]["cache_ratio"] == lo for i in report["items"])
    if lo > 0:  # the first item runs exactly as its calibration trial did
        assert first["quality"]["psnr"] == cal["calibrated_psnr"] >= TARGET
    assert second["quality"]["reference"] == "exact" and second["timing"]["reference_s"] > 0

    # A relaunch of the same command reuses the calibration instead of measuring another item.
    (out / f"{first['id']}.json").unlink()
    result = _run(runner, prompts, out)
    assert result.exit_code == 0, result.stderr
    assert "calibrating" not in result.stderr + result.stdout
    again = json.loads((out / "report.json").read_text())
    assert again["calibration"] == cal
    redone = next(i for i in again["items"] if i["id"] == first["id"])
    assert redone["attention"]["cache_ratio"] == lo and redone["quality"]["psnr"] == first["quality"]["psnr"]


def test_an_item_below_the_target_recalibrates_between_zero_and_the_ratio_in_force(tmp_path, monkeypatch):
    """hold_target on stand-ins: 2 dB below is held, further below bisects again on that item
    (upper end: the ratio in force), lowers the ratio for the rest and keeps it on disk."""
    from dataclasses import dataclass
    from pathlib import Path
    from types import SimpleNamespace

    from planner.ditango import DiTangoOptions, PlannerConfig
    from planner.layout import ParallelLayout
    from runtime import calibrate

    @dataclass(frozen=True)
    class Cfg:  # the RunConfig fields calibration reads
        out_dir: Path
        ditango: DiTangoOptions
        model: str
        layout: ParallelLayout

    calls = []
    monkeypatch.setattr(calibrate, "item_inputs", lambda den, item, cfg: ("text", "latents", None))
    monkeypatch.setattr(calibrate, "exact_reference", lambda den, latents, text, item, cond: "exact latents")

    def bisect(den, item, cfg, ctx, inputs, reference, message, upper):
        calls.append((item.id, reference, upper))
        return {"cache_ratio": 0.3, "calibrated_psnr": 40.5, "trials": [{"cache_ratio": 0.3, "psnr": 40.5}]}

    monkeypatch.setattr(calibrate, "calibrate", bisect)
    planner = PlannerConfig(cache_ratio=0.7, planner="budget")
    cfg = Cfg(tmp_path, DiTangoOptions(planner, target_psnr=40.0), "tiny-wan", ParallelLayout())
    denoiser = SimpleNamespace(ditango=SimpleNamespace(planner_cfg=planner))
    ctx = SimpleNamespace(is_writer=True, from_writer=lambda obj: obj)
    record = {"target_psnr": 40.0, "cache_ratio": 0.7, "planner": "budget", "item": "a", "trials": []}
    item = SimpleNamespace(id="b")

    for held in (38.5, 41.0, None):  # within 2 dB, above, identical frames
        out, redo = calibrate.hold_target(
            denoiser, item, cfg, ctx, print, "report.json", record, {"quality": {"psnr": held}}
        )
        assert redo is None and out is cfg and not calls
    out, redo = calibrate.hold_target(
        denoiser, item, cfg, ctx, print, "report.json", record, {"quality": {"psnr": 37.9}}
    )
    assert calls == [("b", "exact latents", 0.7)] and redo == "exact latents"
    assert out.ditango.planner.cache_ratio == 0.3 and denoiser.ditango.planner_cfg.cache_ratio == 0.3
    assert record["cache_ratio"] == 0.3 and record["recalibrated"][0]["from"] == 0.7
    assert (record["item"], record["calibrated_psnr"]) == ("b", 40.5)  # what is in force, and where it was measured
    stored = json.loads(calibrate.calibration_path(tmp_path, "report.json").read_text())
    assert stored["cache_ratio"] == 0.3 and stored["key"] == calibrate.calibration_key(cfg)


@pytest.mark.parametrize("writer", [True, False])
def test_the_calibration_decodes_as_the_run_with_the_transformer_offloaded_and_the_others_wait_on_control(
    monkeypatch, writer
):
    """Bug: the calibration decoded untiled while the run decoded tiled (its PSNR counted tile
    seams), kept the transformer on the GPU where the pre-flight had chosen to offload it for the
    decode, and the other ranks went on into the first trial's step collective (the step timeout)
    while the writer decoded the reference."""
    from types import SimpleNamespace

    import torch

    from planner.ditango import DiTangoOptions, PlannerConfig
    from runtime import calibrate
    from runtime.config import DecodeOptions

    events = []
    monkeypatch.setattr(calibrate, "place", lambda modules, device: events.append(("place", device.type)))
    monkeypatch.setattr(calibrate, "psnr", lambda a, b: 50.0)
    planner = PlannerConfig(cache_ratio=0.5)
    denoiser = SimpleNamespace(
        ditango=SimpleNamespace(planner_cfg=planner),
        transformers=["the transformer"],
        device=torch.device("cuda", 0),
        decode_with=lambda latents, options, ctx=None: events.append(("decode", options)) or ("frames", {}),
        denoise=lambda *a, **k: events.append(("denoise",)) or SimpleNamespace(latents_BCFHW="latents"),
    )
    # The writer's word reaches every rank: its PSNR (50 dB) for a trial.
    ctx = SimpleNamespace(is_writer=writer, from_writer=lambda obj: events.append(("from_writer",)) or 50.0)
    cfg = SimpleNamespace(
        ditango=DiTangoOptions(planner, target_psnr=40.0),
        decode=DecodeOptions(parallel=True, tile_px=128),
        offload=("transformer",),
    )
    item = SimpleNamespace(id="a", steps=4, cfg_scale=5.0, guidance_2=None, sampler=None)
    calibrate.calibrate(denoiser, item, cfg, ctx, ("text", "noise", None), "exact latents")
    decodes = [e[1] for e in events if e[0] == "decode"]
    if not writer:
        assert decodes == [] and events[:2] == [("from_writer",), ("denoise",)]
        return
    assert decodes and all(o == DecodeOptions(tiling=True, parallel=False, tile_px=128) for o in decodes)
    first = events.index(("denoise",))
    assert events[:first] == [("place", "cpu"), ("decode", decodes[0]), ("place", "cuda"), ("from_writer",)]
    for i, e in enumerate(events):  # every decode between an offload and the way back
        if e[0] == "decode":
            assert events[i - 1] == ("place", "cpu") and events[i + 1] == ("place", "cuda")
