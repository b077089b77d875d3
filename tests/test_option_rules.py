"""Options that mean something only beside others (ditango_cli/requires.py): typed where they
would change nothing, refused in one line; set by a run file whose context the command line
changed, left out with a note. Each refusal here was once an option silently ignored."""

from __future__ import annotations

import inspect
import json
from dataclasses import fields

import pytest

from ditango_cli.app import app
from ditango_cli.generate_options import GenerateArgs
from ditango_cli.options import GROUPS
from ditango_cli.requires import GENERATE_RULES, SIMULATE_RULES
from ditango_cli.simulate import simulate

from .conftest import refused


def test_every_rule_names_options_that_exist():
    """A misspelt name in a rule would never match: the rule would be silently off."""
    run_options = {f.name for group in (*GROUPS, GenerateArgs) for f in fields(group)}
    simulate_options = set(inspect.signature(simulate).parameters)
    for rules, known in ((GENERATE_RULES, run_options), (SIMULATE_RULES, simulate_options)):
        for rule in rules:
            assert set(rule.options) <= known, set(rule.options) - known


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--download"], "--download only applies to a model named by registry name or repo id"),
        (["--revision", "main"], "--revision only applies to a model from the Hub"),
        (["--objective", "latency"], "--objective only applies with --layout auto"),
        (["--objective", "throughput"], "--objective only applies with --layout auto"),
        (["--hardware", "h100"], "--hardware only applies with --layout auto"),
        (["--allow-reuse"], "--allow-reuse only applies with --layout auto"),
        (["--executor", "local", "--partition", "gpu", "--time", "30"], "--partition, --time only apply to a Slurm"),
        (["--executor", "local", "--no-wait"], "--no-wait only applies to a Slurm submission"),
        (["--executor", "local", "--array-parallelism", "2"], "--array-parallelism only applies to a Slurm"),
        (["--vae-parallel"], "--vae-parallel only applies on more than one rank"),
        (["--shard-weights"], "--shard-weights only applies over a context-parallel group of several ranks"),
        (["--gpus", "2", "--cfg-parallel", "--shard-weights"], "--shard-weights only applies over a context-parallel"),
        (["--hybrid-first-text", "uncond"], "--hybrid-first-text only applies with --hybrid"),
        (["--gpus", "2", "--parallel", "ring", "--cache-ratio", "0.3"], "--cache-ratio only applies to --parallel"),
        (
            ["--gpus", "2", "--parallel", "ring", "--no-vae-parallel", "--reference", "exact"],
            "--reference only applies to what it measures against exact",
        ),
    ],
)
def test_an_option_typed_where_it_means_nothing_is_refused(runner, tmp_path, args, needle):
    for command in ("check", "generate"):
        out = tmp_path / command
        result = runner.invoke(app, [command, "--prompt", "a", "--device", "cpu", "--out", str(out), *args])
        refused(result, needle)
        assert not out.exists()


def test_job_options_inside_an_allocation_are_refused_and_say_why(runner, tmp_path, monkeypatch):
    """In an allocation the ranks are srun steps of it: a partition or a time limit would change
    nothing, even with --executor slurm (which submits only outside one)."""
    monkeypatch.setenv("SLURM_JOB_ID", "123")
    monkeypatch.delenv("SLURMD_NODENAME", raising=False)
    for command in ("check", "generate"):
        out = tmp_path / command
        args = [command, "--prompt", "a", "--device", "cpu", "--gpus", "2", "--executor", "slurm", "--out", str(out)]
        refused(runner.invoke(app, [*args, "--partition", "gpu"]), "inside an allocation, SLURM_JOB_ID set")
        assert not out.exists()


@pytest.mark.parametrize(
    "args",
    [
        ["--gpus", "2", "--layout", "auto", "--objective", "latency", "--hardware", "h100"],
        ["--gpus", "2", "--layout", "auto", "--allow-reuse"],
        ["--gpus", "2", "--parallel", "ring", "--attention", "reference", "--reference", "exact"],
        ["--attention", "sdpa"],  # one rank: diffusers' attention runs it
        ["--attention-backend", "auto"],  # the option's older name
        ["--no-vae-parallel"],
    ],
)
def test_the_same_options_where_they_mean_something_pass(runner, args):
    result = runner.invoke(app, ["check", "--prompt", "a", "--device", "cpu", *args])
    assert result.exit_code == 0, result.stderr[-2000:]


def test_a_model_folder_takes_no_hub_options(runner, tmp_path, saved_model_dir):
    """A folder is read where it is: a revision, a model root or a download would change nothing."""
    for args, needle in (
        (["--revision", "main"], "--revision only applies"),
        (["--model-root", str(tmp_path)], "--model-root only applies"),
        (["--download"], "--download only applies"),
    ):
        refused(runner.invoke(app, ["check", "--model", str(saved_model_dir), "--prompt", "a", *args]), needle)


def test_a_run_files_options_the_command_line_made_moot_are_left_out_with_a_note(runner, tmp_path):
    """A cluster's run file checked with --executor local: its Slurm and layout-search settings
    cannot apply; each is named in a note and the run goes on. A report's recorded options (every
    option, at its default too) rerun without a note."""
    run_file = tmp_path / "run.toml"
    run_file.write_text('prompt = "a"\ndevice = "cpu"\n[parallel]\nobjective = "latency"\n[slurm]\npartition = "gpu"\n')
    result = runner.invoke(app, ["check", "--config", str(run_file), "--executor", "local"])
    assert result.exit_code == 0, result.stderr[-2000:]
    notes = [line for line in result.stderr.splitlines() if line.startswith("note: ")]
    assert any(f"--objective from {run_file} only applies with --layout auto: left out" in n for n in notes), notes
    assert any(f"--partition from {run_file} only applies to a Slurm submission" in n for n in notes), notes
    report = tmp_path / "report.json"
    options = {
        "prompt": "a",
        "device": "cpu",
        "objective": "throughput",
        "time": 60,
        "wait": True,
        "attention_backend": "auto",
        "allow_reuse": False,
        "executor": "auto",
    }
    report.write_text(json.dumps({"options": options}))
    again = runner.invoke(app, ["check", "--config", str(report), "--out", str(tmp_path / "out")])
    assert again.exit_code == 0 and "note:" not in again.stderr, again.stderr[-2000:]
    typed = runner.invoke(app, ["check", "--config", str(run_file), "--executor", "local", "--objective", "latency"])
    refused(typed, "--objective only applies with --layout auto")  # typed: the user's own word


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--guidance", "nan", "--batch", "4"], "guidance must be a finite number >= 0, got nan"),
        (["--guidance", "inf", "--batch", "4"], "guidance must be a finite number >= 0, got inf"),
        (["--guidance", "3"], "--guidance only applies to the ranking of layouts"),
        (["--allow-reuse"], "--allow-reuse only applies to the ranking of layouts"),
        (["--batch", "4", "--parallel", "ring"], "--parallel only applies to the strategy table"),
        (["--objective", "latency", "--shard-weights"], "--shard-weights only applies to the strategy table"),
        (["--parallel", "ring", "--cache-ratio", "0.3"], "--cache-ratio only applies where DiTango is priced"),
        (["--batch", "4", "--warmup", "3"], "--warmup only applies where DiTango is priced"),
        (["--plan-item", "a"], "--plan-item only applies with --plan"),
        (["--parallel", "ring", "--cache-dtype", "float32"], "--cache-dtype only applies where DiTango is priced"),
        (["--hardware", "h100", "--hardware-file", "x.json"], "--hardware only applies without --hardware-file"),
    ],
)
def test_simulate_refuses_what_it_would_not_price(runner, args, needle):
    refused(runner.invoke(app, ["simulate", "--nodes", "2", *args]), needle)


def test_simulate_prices_a_guidance_in_the_ranking(runner):
    one = json.loads(
        runner.invoke(app, ["simulate", "--nodes", "2", "--batch", "4", "--guidance", "1", "--json"]).stdout
    )
    two = json.loads(
        runner.invoke(app, ["simulate", "--nodes", "2", "--batch", "4", "--guidance", "5", "--json"]).stdout
    )
    assert one["ranking"][0]["e2e_s"] < two["ranking"][0]["e2e_s"]  # one CFG branch a step, not two


@pytest.mark.parametrize("where", ["run.toml", "report.json"])
def test_a_run_files_old_attention_value_torch_reads_as_sdpa(runner, tmp_path, where):
    """--attention-backend torch was renamed sdpa: run files and reports written before still run."""
    path = tmp_path / where
    if where == "report.json":
        path.write_text(json.dumps({"options": {"prompt": "a", "device": "cpu", "attention_backend": "torch"}}))
    else:
        path.write_text('prompt = "a"\ndevice = "cpu"\n[parallel]\nattention_backend = "torch"\n')
    result = runner.invoke(app, ["check", "--config", str(path), "--json", "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.stderr[-2000:]
    assert json.loads(result.stdout)["attention_backend"] == "sdpa"
    typed = runner.invoke(app, ["check", "--prompt", "a", "--device", "cpu", "--attention", "torch"])
    assert typed.exit_code != 0 and "torch" in typed.stderr  # the command line takes the new names only
