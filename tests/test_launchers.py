"""Ranks another launcher started (torchrun; Kubernetes and MPI set the same variables):
`ditango generate` runs as that rank (slurm/launchers/env.py), chosen by itself or by `--executor env`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from basics.errors import ConfigError
from ditango_cli.app import app
from slurm.launchers.env import launcher_layout
from slurm.options import SlurmOptions, choose_executor
from slurm.rank import LAUNCHER_VARIABLES, LaunchedRank, launched_rank

from .conftest import FAST_ARGV

TORCHRUN = Path(sys.executable).parent / "torchrun"
DITANGO = Path(sys.executable).parent / "ditango"
PROMPTS = ["a red circle moving left", "a blue square moving up"]
LATENT_TOL = 1e-4  # ring attention vs one process: float32 sums in another order
TORCHRUN_S = 240  # the whole torchrun command, as a bound: a hang fails the test


def launcher_env(rank: int = 1, world: int = 2, local: int = 1) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29555",
    }


def test_the_launcher_variables_name_this_rank(monkeypatch):
    assert launched_rank(launcher_env(1, 4, 1) | {"GROUP_RANK": "0"}) == LaunchedRank(1, 4, 1, "0")
    for name in ("RANK", "WORLD_SIZE"):  # without them, it is no launcher's rank
        assert launched_rank({k: v for k, v in launcher_env().items() if k != name}) is None
    for name in set(LAUNCHER_VARIABLES) - {"RANK", "WORLD_SIZE"}:  # a rank of 2, half described: said
        with pytest.raises(ConfigError, match=f"RANK and WORLD_SIZE=2 are set, {name} not"):
            launched_rank({k: v for k, v in launcher_env().items() if k != name})
    with pytest.raises(ConfigError, match="RANK='one'"):
        launched_rank(launcher_env() | {"RANK": "one"})
    with pytest.raises(ConfigError, match="RANK=2 is not below WORLD_SIZE=2"):
        launched_rank(launcher_env(2, 2))


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("RANK", "\u00b2", "RANK='\u00b2' (set by the launcher) is not a rank number"),  # str.isdigit() passes it
        ("WORLD_SIZE", "\u0662", "WORLD_SIZE='\u0662'"),
        ("LOCAL_RANK", "-1", "LOCAL_RANK='-1'"),
        ("WORLD_SIZE", " ", "WORLD_SIZE=' ' (set by the launcher) is not a rank number"),
        ("MASTER_PORT", "abc", "MASTER_PORT='abc' (set by the launcher) is not a port number (1-65535)"),
        ("MASTER_PORT", "70000", "MASTER_PORT='70000'"),
        ("MASTER_PORT", "0", "MASTER_PORT='0'"),
        ("MASTER_ADDR", "node 1", "MASTER_ADDR='node 1' (set by the launcher) is not a host name or address"),
        ("LOCAL_WORLD_SIZE", "\u00b2", "LOCAL_WORLD_SIZE='\u00b2' (set by the launcher) is not a number of ranks"),
        ("TORCHELASTIC_RESTART_COUNT", "x", "TORCHELASTIC_RESTART_COUNT='x'"),
        (
            "LOCAL_WORLD_SIZE",
            "8",
            "LOCAL_WORLD_SIZE='8' (set by the launcher) is not a number of ranks up to WORLD_SIZE=2",
        ),
    ],
)
def test_a_launcher_variable_of_the_wrong_kind_is_named_in_one_line(
    runner, tmp_path, monkeypatch, variable, value, needle
):
    """The bugs: RANK='\u00b2' passed str.isdigit() and failed int(); MASTER_PORT=abc reached torch,
    whose error named neither the variable nor a usage error."""
    from .conftest import refused

    for key, given in (launcher_env(0, 2, 0) | {variable: value}).items():
        monkeypatch.setenv(key, given)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        launched_rank()
    refused(runner.invoke(app, ["generate", "--prompt", "a", "--out", str(tmp_path / "out"), *FAST_ARGV]), needle)
    assert not (tmp_path / "out").exists()


def test_auto_runs_as_the_launchers_rank_and_env_needs_one(monkeypatch):
    for key, value in launcher_env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SLURM_JOB_ID", "123")  # torchrun inside an allocation: the ranks are started already
    assert choose_executor("auto", 1, SlurmOptions()) == "env"
    assert choose_executor("local", 1, SlurmOptions()) == "local"
    for key in ("MASTER_PORT", "SLURM_JOB_ID"):
        monkeypatch.delenv(key)
    for requested in ("auto", "env"):  # a rank of 2 without its rendezvous port: said, never run as one process
        with pytest.raises(ConfigError, match="RANK and WORLD_SIZE=2 are set, MASTER_PORT not"):
            choose_executor(requested, 1, SlurmOptions(), ranks=1)
    assert choose_executor("local", 1, SlurmOptions()) == "local"
    monkeypatch.delenv("RANK")
    assert choose_executor("auto", 1, SlurmOptions(), ranks=1) == "local"
    with pytest.raises(ConfigError, match=r"--executor env: no launcher started this process \(RANK, MASTER_PORT not"):
        choose_executor("env", 1, SlurmOptions())


def test_the_layout_is_the_launchers_unless_given():
    assert launched_rank(launcher_env(0, 8, 0) | {"LOCAL_WORLD_SIZE": "4"}).local_size == 4
    assert launcher_layout(LaunchedRank(0, 8, 0, "a", local_size=4), 1, 1) == (2, 4)
    assert launcher_layout(LaunchedRank(0, 8, 0, "a", local_size=3), 1, 1) == (8, 1)  # not a whole number of nodes
    assert launcher_layout(LaunchedRank(0, 8, 0, "a"), 1, 1) == (8, 1)  # a pod per rank
    assert launcher_layout(LaunchedRank(0, 8, 0, "a"), 1, 1) == (8, 1)
    assert launcher_layout(LaunchedRank(0, 8, 0, "a"), 4, 2) == (4, 2)
    with pytest.raises(ConfigError, match="--nodes 2 x --gpus-per-node 2 is 4 rank.*launcher started 8"):
        launcher_layout(LaunchedRank(0, 8, 0, "a"), 2, 2)


def test_a_dry_run_under_a_launcher_shows_its_ranks(runner, tmp_path, monkeypatch):
    for key, value in launcher_env(0, 2, 0).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = [
        "generate",
        "--prompt",
        "a red circle",
        "--out",
        str(tmp_path / "out"),
        "--parallel",
        "ring",
        "--dry-run",
        "--json",
        *FAST_ARGV,
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.stderr
    shown = json.loads(result.stdout)
    assert shown["executor"] == "env" and shown["layout"]["world_size"] == 2 and shown["tasks_per_node"] == 2
    with_replicas = runner.invoke(app, [*args, "--replicas", "2"])
    assert with_replicas.exit_code == 2 and "--replicas with a launcher's ranks" in with_replicas.stderr
    # No strategy named: the launcher's ranks are one replica, ring over them (no layout search).
    unnamed = runner.invoke(app, [a for a in args if a not in ("--parallel", "ring")])
    assert unnamed.exit_code == 0, unnamed.stderr
    shown = json.loads(unnamed.stdout)
    assert shown["layout"]["strategy"] == "ring" and shown["layout_choice"] is None


def torchrun(out: Path, *extra: str, env: dict | None = None, prompts=PROMPTS, restarts: int = 0):
    batch = out.parent / f"{out.name}.txt"
    batch.write_text("\n".join(prompts) + "\n")
    cmd = [
        str(TORCHRUN),
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(restarts),
        str(DITANGO),
        "generate",
        "--prompts",
        str(batch),
        "--out",
        str(out),
        "--parallel",
        "ring",
        "--save-latents",
        *FAST_ARGV,
        *extra,
    ]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("DITANGO_FAULT", "SLURM_"))}
    if restarts:  # as docs/clusters.md says: torchrun's shared store does not survive its restarts
        clean["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TORCHRUN_S, env={**clean, **(env or {})})


@pytest.mark.distributed
@pytest.mark.e2e
def test_torchrun_ranks_make_the_same_latents_as_one_process(runner, tmp_path):
    """Two ranks under torchrun: ring attention over the launcher's process group, one writer:
    one MP4 and sidecar per item, one report, the latents of a one-process run."""
    ran = torchrun(tmp_path / "ranks", "--seed", "3")
    assert ran.returncode == 0, ran.stderr[-3000:]
    batch = tmp_path / "one.txt"
    batch.write_text("\n".join(PROMPTS) + "\n")
    one = runner.invoke(
        app,
        [
            "generate",
            "--prompts",
            str(batch),
            "--out",
            str(tmp_path / "one"),
            "--seed",
            "3",
            "--save-latents",
            *FAST_ARGV,
        ],
    )
    assert one.exit_code == 0, one.stderr
    report = json.loads((tmp_path / "ranks" / "report.json").read_text())
    assert report["layout"]["world_size"] == 2 and report["layout"]["strategy"] == "ring"
    assert report["counts"] == {"done": 2, "skipped": 0, "failed": 0}
    assert sorted(p.name for p in (tmp_path / "ranks").glob("*.mp4")) == sorted(
        p.name for p in (tmp_path / "one").glob("*.mp4")
    )
    assert not list((tmp_path / "ranks").glob(".ditango/reports/*.json"))  # one report: report.json
    for record in report["items"]:
        assert record["comm"]["intra_node_bytes"] > 0  # the ranks did talk: it was not two whole runs
        ours = load_file(tmp_path / "ranks" / record["latents"])["latents"]
        theirs = load_file(tmp_path / "one" / record["latents"])["latents"]
        assert (ours - theirs).abs().max().item() <= LATENT_TOL


@pytest.mark.distributed
@pytest.mark.parametrize("kind", ["kill", "raise"])
@pytest.mark.e2e
def test_a_failed_torchrun_worker_ends_the_job_and_is_named(tmp_path, kind):
    """Rank 1 dies (SIGKILL) or raises after step 2 of the first item: the job ends, torchrun's
    summary blames rank 1 (not rank 0, which only saw it go), and rank 0 records the item failed;
    the same command then resumes and makes it."""
    out = tmp_path / "out"
    start = time.monotonic()
    ran = torchrun(out, env={"DITANGO_FAULT_INJECT": "1:2", "DITANGO_FAULT_KIND": kind}, prompts=PROMPTS[:1])
    assert ran.returncode != 0
    assert time.monotonic() - start < TORCHRUN_S
    cause = ran.stderr.split("Root Cause (first observed failure):")[1]
    assert "rank      : 1 (local_rank: 1)" in cause, cause
    if kind == "kill":
        assert "SIGKILL" in cause
    else:
        assert "injected fault on rank 1 after step 2" in cause
        assert "error: rank 1: RuntimeError: injected fault" in ran.stderr
    (sidecar,) = out.glob("*.json")
    record = json.loads(sidecar.read_text())
    assert record["status"] == "failed"
    if kind == "raise":
        assert record["error"].startswith("rank 1: RuntimeError: injected fault")
    if kind == "kill":  # the next launch resumes (once: the path is the same for either kind)
        again = torchrun(out, prompts=PROMPTS[:1])
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads((out / "report.json").read_text())["counts"]["done"] == 1


def test_the_kubernetes_example_runs_a_command_generate_accepts():
    """examples/kubernetes/ditango-job.yaml: torchrun on every pod of an Indexed Job, each
    naming its node rank, pod 0 the rendezvous host through the headless Service; every option
    it passes to `ditango generate` is one generate has."""
    import typer.main
    import yaml

    path = Path(__file__).resolve().parent.parent / "examples" / "kubernetes" / "ditango-job.yaml"
    service, job = yaml.safe_load_all(path.read_text())
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == service["metadata"]["name"]
    (container,) = pod["containers"]
    args = container["args"]
    torchrun_args = dict(a.removeprefix("--").split("=", 1) for a in args[: args.index("generate") - 1])
    assert int(torchrun_args["nnodes"]) == spec["completions"]
    assert torchrun_args["node-rank"] == "$(JOB_COMPLETION_INDEX)"
    assert torchrun_args["master-addr"] == f"{job['metadata']['name']}-0.{service['metadata']['name']}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == int(torchrun_args["nproc-per-node"])
    generate = typer.main.get_command(app).commands["generate"]
    known = {opt for param in generate.params for opt in param.opts}
    given = [a.split("=", 1)[0] for a in args[args.index("generate") + 1 :]]
    assert given and all(flag in known for flag in given), set(given) - known


def test_ranks_never_download(runner, tmp_path, monkeypatch):
    """--download under a launcher would fetch the model on every rank: refused, naming the
    command that fetches it once."""
    for key, value in launcher_env(0, 2, 0).items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(
        app,
        [
            "generate",
            "--prompt",
            "a red circle",
            "--out",
            str(tmp_path / "out"),
            "--model",
            "wan2.1-1.3b",
            "--download",
            *FAST_ARGV,
        ],
    )
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "--download under a launcher's ranks" in line and "ditango download wan2.1-1.3b" in line


@pytest.mark.distributed
@pytest.mark.e2e
def test_a_folder_another_run_owns_ends_every_rank_in_one_line(tmp_path):
    """Rank 0 alone asks for the output folder and every rank hears the answer: a folder held by
    a live run ends the job at once (no rank waits in the broadcast for the setup timeout), with
    the owner named on rank 0's one line and exit 2 everywhere."""
    from runtime.lock import FolderLock

    out = tmp_path / "out"
    out.mkdir()
    lock = FolderLock(out).acquire(say=lambda text: None)  # this test process: a live owner
    try:
        start = time.monotonic()
        ran = torchrun(out, "--timeout", "60", "--setup-timeout", "120", prompts=PROMPTS[:1])
    finally:
        lock.release()
    assert ran.returncode != 0 and time.monotonic() - start < 60
    said = [ln for ln in ran.stderr.splitlines() if ln.startswith("error:")]
    assert said and all(ln == said[0] for ln in said) and f"pid {os.getpid()}" in said[0], ran.stderr[-2000:]
    assert "exitcode  : 2" in ran.stderr and not list(out.glob("*.mp4"))


@pytest.mark.distributed
@pytest.mark.e2e
def test_torchrun_restarts_count_an_items_attempts_and_give_it_up(tmp_path):
    """Rank 0 is killed mid-item (as NCCL's blocked rank or the OOM killer leave it: nothing
    recorded) in every launch. Each torchrun restart records what the previous launch left
    running, counts the attempts over the restarts (not per launch), and once --retries is
    spent gives the item up: the last launch runs nothing and ends non-zero."""
    out = tmp_path / "out"
    ran = torchrun(
        out,
        "--retries",
        "1",
        env={"DITANGO_FAULT_INJECT": "0:2", "DITANGO_FAULT_KIND": "kill"},
        prompts=PROMPTS[:1],
        restarts=2,
    )
    assert ran.returncode != 0
    # Killed in the first two launches; the third has nothing to run (given up) and ends 1.
    assert ran.stderr.count("failed (exitcode: -9) local_rank: 0") == 2, ran.stderr[-3000:]
    assert "failed (exitcode: 1) local_rank: 0" in ran.stderr
    (sidecar,) = (p for p in out.glob("*.json") if p.name != "report.json")
    record = json.loads(sidecar.read_text())
    assert record["status"] == "failed" and record["attempts"] == 2
    assert record["error"].startswith("previous launch: a rank ended without saying why")
    report = json.loads((out / "report.json").read_text())
    assert report["counts"] == {"done": 0, "skipped": 0, "failed": 1}
    # A new torchrun (restart count 0) is a new command: it retries the item, and makes it.
    again = torchrun(out, prompts=PROMPTS[:1])
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((out / "report.json").read_text())["counts"]["done"] == 1


@pytest.mark.e2e
def test_a_resume_refused_under_a_launcher_is_one_line_and_exit_2(runner, tmp_path):
    """The bug: outputs made with other settings refused the run only inside the ranks, as
    `error: rank 0: ConfigError` with exit 1 and error files; every other executor refuses it
    in one line with exit 2 before anything runs. The folder is given back (no lock left)."""
    import socket

    out = tmp_path / "out"
    made = runner.invoke(app, ["generate", "--prompt", PROMPTS[0], "--out", str(out), *FAST_ARGV])
    assert made.exit_code == 0, made.stderr[-2000:]
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DITANGO_FAULT", "SLURM_"))}
    env |= launcher_env(0, 1, 0) | {"MASTER_PORT": str(port)}
    ran = subprocess.run(
        [str(DITANGO), "generate", "--prompt", PROMPTS[0], "--out", str(out), *FAST_ARGV, "--steps", "4"],
        capture_output=True,
        text=True,
        timeout=TORCHRUN_S,
        env=env,
    )
    assert ran.returncode == 2, ran.stderr[-3000:]
    (line,) = [ln for ln in ran.stderr.splitlines() if ln.strip()]
    assert line.startswith("error: --prompt: ") and "made with steps 3, not 4" in line, line
    assert not list((out / ".ditango").glob("ranks/*.error")) and not (out / ".ditango" / "lock").exists()


def test_wait_for_lock_is_refused_under_a_launcher(runner, tmp_path, monkeypatch):
    """Rank 0 waiting for the folder would leave the other ranks to time out in the broadcast."""
    for key, value in launcher_env(0, 2, 0).items():
        monkeypatch.setenv(key, value)
    result = runner.invoke(
        app, ["generate", "--prompt", "a red circle", "--out", str(tmp_path / "out"), "--wait-for-lock", *FAST_ARGV]
    )
    assert result.exit_code == 2
    (line,) = result.stderr.strip().splitlines()
    assert "--wait-for-lock under a launcher's ranks" in line


def test_a_failure_after_the_folder_is_owned_is_this_ranks_and_recorded(tmp_path, monkeypatch):
    """A ConfigError while the items run (a model directory that does not load on this node)
    is this rank's failure like any other: its error file for the launcher, not a bare exit 2."""
    import slurm.launchers.env as env_mod
    from runtime.config import Item, RunConfig
    from runtime.errors import ModelDirError

    cfg = RunConfig(
        "tiny-wan", None, (Item("a", "a red circle", "", 0, 64, 64, 5, 2, 5.0),), tmp_path / "out", device="cpu"
    )
    launched = LaunchedRank(0, 1, 0, "a")
    monkeypatch.setattr(env_mod, "join", lambda *a, **k: None)
    monkeypatch.setattr(env_mod, "_own_folder", lambda *a: (None, None, {}, None))

    def broken(*args):
        raise ModelDirError("cannot load the model from /m: OSError: no file named model.safetensors")

    monkeypatch.setattr(env_mod, "_tasks", broken)
    monkeypatch.setattr(env_mod, "exit_soon", lambda: None)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    with pytest.raises(env_mod.LaunchedRankFailed, match="rank 0: ModelDirError: cannot load the model"):
        env_mod.run_launched(cfg, launched, 1, None, lambda text: None)
    message = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
    assert message.startswith("rank 0: ModelDirError")
    assert (env_mod.errors_dir(cfg.out_dir) / "rank-0.error").is_file()
