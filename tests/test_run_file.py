"""Run files: `--config run.toml` holds any generate option, the command line overrides it,
unknown keys are a one-line error, and a report's recorded options repeat its run."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from ditango_cli.app import app

SMALL = ["--height", "32", "--width", "32", "--frames", "5", "--device", "cpu", "--quiet", "--save-latents"]


def latents(out):
    (path,) = out.glob("*.latents.safetensors")
    return load_file(path)["latents"]


@pytest.mark.distributed
@pytest.mark.e2e
def test_run_file_equals_the_command_line_and_the_command_line_wins(runner, tmp_path):
    run = tmp_path / "run.toml"
    run.write_text(
        'prompt = "a green square moving right"\nnegative_prompt = "blurry"\nsteps = 3\n'
        "[items]\nseed = 7\nguidance = 3.0\n"
        '[parallel]\ngpus_per_node = 2\nparallel = "ring"\n'
    )
    cli = [
        "generate",
        "--prompt",
        "a green square moving right",
        "--negative-prompt",
        "blurry",
        "--steps",
        "3",
        "--seed",
        "7",
        "--guidance",
        "3.0",
        "--gpus",
        "2",
        "--parallel",
        "ring",
        *SMALL,
    ]
    assert runner.invoke(app, [*cli, "--out", str(tmp_path / "cli")]).exit_code == 0
    result = runner.invoke(app, ["generate", "--config", str(run), *SMALL, "--out", str(tmp_path / "file")])
    assert result.exit_code == 0, result.stderr
    assert (latents(tmp_path / "cli") == latents(tmp_path / "file")).all()
    report = json.loads((tmp_path / "file" / "report.json").read_text())
    assert report["options"]["seed"] == 7 and report["options"]["parallel"] == "ring"
    assert report["layout"]["world_size"] == 2

    # The command line overrides the file: another seed, other latents; the rest from the file.
    result = runner.invoke(app, ["generate", "--config", str(run), "--seed", "8", *SMALL, "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.stderr
    item = json.loads((tmp_path / "o" / "report.json").read_text())["items"][0]
    assert (item["seed"], item["steps"], item["guidance"], item["negative_prompt"]) == (8, 3, 3.0, "blurry")

    # A report repeats its run: --config report.json gives the same latents.
    again = runner.invoke(
        app, ["generate", "--config", str(tmp_path / "file" / "report.json"), "--out", str(tmp_path / "again")]
    )
    assert again.exit_code == 0, again.stderr
    assert (latents(tmp_path / "again") == latents(tmp_path / "file")).all()


@pytest.mark.parametrize(
    "body,needle",
    [
        ("bogus = 1\n", "unknown key 'bogus'"),
        ("[slurm]\nseed = 1\n", "unknown key 'seed' in [slurm]"),
        ("[nowhere]\nseed = 1\n", "unknown key 'nowhere'"),
        ('steps = "many"\n', "steps = 'many'"),
        ('parallel = "spiral"\n', "'spiral' is not one of"),
        ("dry_run = true\n", "'dry_run' is not a run setting"),
        ("steps = \n", "not valid TOML"),
    ],
)
def test_bad_run_files_are_one_line_errors(runner, tmp_path, body, needle):
    run = tmp_path / "run.toml"
    run.write_text(body)
    result = runner.invoke(app, ["generate", "--config", str(run), "--prompt", "x", "--out", str(tmp_path / "o")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --config") and needle in lines[0], result.stderr
    assert not (tmp_path / "o").exists()
