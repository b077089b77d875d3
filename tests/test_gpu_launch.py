"""GPU launch logic on a machine without GPUs: CUDA availability and device counts are
monkeypatched, and what would reach NCCL (the device, `init_process_group`'s arguments, the
environment) is captured instead of run. One GPU cannot run a multi-rank NCCL job, so this is
where device mapping, GPU requests and the NCCL settings are proven."""

from __future__ import annotations

import json
import os
import pickle
import re
import sys
from pathlib import Path

import pytest
import torch

from basics.errors import ConfigError
from ditango_cli.app import app
from planner.layout import ParallelLayout
from runtime.config import Item, RunConfig
from slurm import rank as rank_mod
from slurm.placement import rank_slots

SMALL = ["--prompt", "a red ball", "--steps", "2", "--height", "32", "--width", "64", "--frames", "5"]


class FakeCuda:
    """torch.cuda as a node with `count` GPUs would show it, under a CUDA build of torch (no
    kernels run)."""

    def __init__(self, monkeypatch, count: int) -> None:
        self.count, self.current = count, None
        monkeypatch.setattr(torch.version, "cuda", "12.8")
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)

    def set_device(self, index) -> None:
        index = index.index if isinstance(index, torch.device) else index
        assert 0 <= index < self.count, index
        self.current = index


@pytest.fixture
def no_slurm(monkeypatch, tmp_path):
    """A login node without Slurm installed and outside any allocation."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-path") + os.pathsep + str(Path(sys.executable).parent))
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV, raising=False)


def dry_run(runner, *args) -> dict:
    result = runner.invoke(app, ["generate", *SMALL, "--dry-run", "--json", *args])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


# -- GPU requests ----------------------------------------------------------------------------
def test_submission_from_a_cpu_only_host_requests_one_gpu_per_task(runner, no_slurm, monkeypatch, tmp_path):
    """The bug: `--device auto` stayed `auto` and the job asked for no GPUs."""
    FakeCuda(monkeypatch, 0)
    out = tmp_path / "out"
    job = dry_run(runner, "--executor", "slurm", "--nodes", "4", "--gpus", "8", "--out", str(out))
    assert job["executor"] == "sbatch" and job["device"] == "cuda" and job["backend"] == "nccl"
    assert (job["nodes"], job["tasks_per_node"], job["gpus_per_node_requested"]) == (4, 8, 8)
    script = job["sbatch_script"]
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8"):
        assert line in script.splitlines(), line
    assert "--kill-on-bad-exit=1" in script
    assert not out.exists()  # a dry run writes nothing
    assert [r["gpu"] for r in job["ranks"][:9]] == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    assert [r["node"] for r in job["ranks"][7:9]] == [0, 1]

    cpu = dry_run(runner, "--executor", "slurm", "--nodes", "4", "--gpus", "8", "--device", "cpu", "--out", str(out))
    assert cpu["device"] == "cpu" and cpu["gpus_per_node_requested"] == 0 and cpu["backend"] == "gloo"
    assert "gpus" not in cpu["sbatch_script"] and all(r["gpu"] is None for r in cpu["ranks"])


def test_dry_run_prints_the_sbatch_script(runner, no_slurm, monkeypatch, tmp_path):
    FakeCuda(monkeypatch, 0)
    args = ["generate", *SMALL, "--executor", "slurm", "--nodes", "4", "--gpus", "8", "--dry-run"]
    result = runner.invoke(app, [*args, "--out", str(tmp_path / "o"), "--partition", "gpu"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "#!/bin/bash" in lines and "#SBATCH --gpus-per-node=8" in lines and "#SBATCH --partition=gpu" in lines
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=3" in result.stdout and "8 GPU(s) per node requested" in result.stdout


def test_gpu_host_with_fewer_gpus_than_the_world_can_submit(runner, no_slurm, monkeypatch, tmp_path):
    """The bug: the local GPU count was checked for any executor, refusing every multi-node job."""
    FakeCuda(monkeypatch, 2)
    out = str(tmp_path / "out")
    job = dry_run(runner, "--executor", "slurm", "--nodes", "4", "--gpus", "8", "--out", out)
    assert job["gpus_per_node_requested"] == 8
    # Locally the same layout needs 32 GPUs here, and says so.
    result = runner.invoke(
        app,
        ["generate", *SMALL, "--executor", "local", "--nodes", "4", "--gpus", "8", "--device", "cuda", "--out", out],
    )
    assert result.exit_code == 2 and "32 ranks need 32 GPUs on this machine, found 2" in result.stderr


def test_inside_an_allocation_gpus_are_checked_against_the_allocation(runner, no_slurm, monkeypatch, tmp_path):
    FakeCuda(monkeypatch, 0)  # salloc's shell runs on a login node
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_GPUS_PER_NODE", "h100:4")
    out = str(tmp_path / "out")
    job = dry_run(runner, "--nodes", "2", "--gpus", "4", "--out", out)
    assert job["executor"] == "srun" and job["device"] == "cuda"
    assert "--gpus-per-node=4" in job["srun_commands"][0] and "--kill-on-bad-exit=1" in job["srun_commands"][0]
    result = runner.invoke(app, ["generate", *SMALL, "--nodes", "2", "--gpus", "8", "--dry-run", "--out", out])
    assert result.exit_code == 2 and "allocation 42 has 4" in result.stderr
    monkeypatch.delenv("SLURM_GPUS_PER_NODE")  # an allocation without GPUs
    assert dry_run(runner, "--nodes", "2", "--gpus", "4", "--out", out)["device"] == "cpu"
    result = runner.invoke(app, ["generate", *SMALL, "--gpus", "2", "--device", "cuda", "--dry-run", "--out", out])
    assert result.exit_code == 2 and "allocation 42 has no GPUs" in result.stderr


def test_gres_allocation_gpus_come_from_the_job_record(runner, no_slurm, monkeypatch, tmp_path):
    """The bug: `salloc --gres=gpu:4` sets no GPU variable in its shell, so the login node's
    torch count (0) made the ranks run on CPUs without a word. The job record says 4."""
    FakeCuda(monkeypatch, 0)
    bin_dir = tmp_path / "empty-path"  # on PATH (no_slurm): a scontrol that shows job 42
    bin_dir.mkdir()
    scontrol = bin_dir / "scontrol"
    scontrol.write_text("#!/bin/sh\necho 'JobId=42 NumNodes=2 TRES=cpu=2,node=2,gres/gpu=8 TresPerNode=gres:gpu:4'\n")
    scontrol.chmod(0o755)
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    out = str(tmp_path / "out")
    job = dry_run(runner, "--nodes", "2", "--gpus", "4", "--out", out)
    assert job["executor"] == "srun" and job["device"] == "cuda", job["device"]
    assert "--gpus-per-node=4" in job["srun_commands"][0]
    result = runner.invoke(app, ["generate", *SMALL, "--nodes", "2", "--gpus", "8", "--dry-run", "--out", out])
    assert result.exit_code == 2 and "allocation 42 has 4" in result.stderr


def test_allocated_gpus_per_node_reads_every_record_form():
    from slurm.launchers.srun import allocated_gpus_per_node as per_node

    assert per_node("JobId=1 NumNodes=1 TRES=cpu=1,node=1,gres/gpu=2 TresPerNode=gres:gpu:2") == 2
    assert per_node("JobId=1 NumNodes=1 TRES=cpu=1,node=1 TresPerNode=gres/gpu:h100:4") == 4
    assert per_node("JobId=1 NumNodes=2 TRES=cpu=2,node=2,billing=2,gres/gpu=8") == 4  # --gpus 8 over 2 nodes
    assert per_node("JobId=1 NumNodes=1 TRES=cpu=1,node=1,billing=1") == 0  # no GPU in the allocation
    assert per_node("slurm_load_jobs error: Invalid job id specified") is None


def test_submitted_config_insists_on_cuda_unless_cpu(tmp_path):
    from slurm.launchers.sbatch import job_parameters, submission_config
    from slurm.options import SlurmOptions

    for device, gpus in (("auto", 8), ("cuda", 8), ("cpu", None)):
        cfg = submission_config(
            RunConfig("m", None, (ITEM,), Path("out"), device=device, layout=ParallelLayout(4, 8, strategy="ring"))
        )
        assert cfg.device == ("cpu" if device == "cpu" else "cuda") and cfg.out_dir.is_absolute()
        params = job_parameters(cfg, SlurmOptions(), tmp_path / "code")
        assert params.get("gpus_per_node") == gpus and params["srun_args"] == ["--kill-on-bad-exit=1"]


# -- device mapping --------------------------------------------------------------------------
def test_select_device_takes_the_local_rank_gpu(monkeypatch):
    cuda = FakeCuda(monkeypatch, 4)
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV, raising=False)
    assert rank_mod.select_device("cuda", 3) == torch.device("cuda", 3) and cuda.current == 3
    assert rank_mod.select_device("auto", 1) == torch.device("cuda", 1) and cuda.current == 1
    with pytest.raises(ConfigError, match="local rank 4 .* has no GPU of its own: 4 are visible"):
        rank_mod.select_device("cuda", 4)
    assert rank_mod.select_device("cpu", 3) == torch.device("cpu")
    monkeypatch.setenv(rank_mod.RANK_DEVICE_ENV, "cpu")  # the documented test setting
    assert rank_mod.select_device("cuda", 3) == torch.device("cpu")
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV)
    FakeCuda(monkeypatch, 1)  # Slurm binding one GPU to each task
    assert rank_mod.select_device("cuda", 5) == torch.device("cuda", 0)
    # torchrun binds nothing: 2 ranks on a node that shows one GPU would share it.
    with pytest.raises(ConfigError, match=r"started 2 ranks on .*LOCAL_WORLD_SIZE.*1 GPU\(s\) are visible"):
        rank_mod.select_device("cuda", 1, local_size=2)
    assert rank_mod.select_device("cuda", 0, local_size=1) == torch.device("cuda", 0)  # a pod per rank
    FakeCuda(monkeypatch, 8)
    assert rank_mod.select_device("cuda", 7, local_size=8) == torch.device("cuda", 7)


def test_a_node_without_gpus_is_an_error_when_gpus_were_asked_for(monkeypatch):
    FakeCuda(monkeypatch, 0)
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV, raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(ConfigError, match=r"asked for GPUs, .* no CUDA device .*CUDA_VISIBLE_DEVICES=0,1"):
        rank_mod.select_device("cuda", 0)
    assert rank_mod.select_device("auto", 0) == torch.device("cpu")  # local auto: CPU is what was asked


ITEM = Item("a", "a red circle", "", 0, 480, 832, 81, 50, 5.0)


def two_nodes_four_replicas(out: Path = Path("/out"), **kwargs) -> RunConfig:
    """2 nodes x 4 GPUs as 4 replicas of 2 ranks (two replicas per node)."""
    return RunConfig(
        "m",
        None,
        (ITEM,),
        out,
        device="cuda",
        layout=ParallelLayout(1, 2, strategy="ring"),
        replicas=4,
        alloc_gpus_per_node=4,
        **kwargs,
    )


def clean_nccl_environment(monkeypatch, tmp_path) -> None:
    """Unset the NCCL settings for the test, and have them unset again after it."""
    for key in rank_mod.nccl_environment(tmp_path):
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)


def test_replicas_use_their_own_local_gpus():
    """The bug: the model went to cuda:(rank inside the replica), piling replicas onto the first GPUs."""
    cfg = two_nodes_four_replicas()
    slots = rank_slots(cfg)
    assert [(s.replica, s.replica_rank, s.node, s.gpu) for s in slots] == [
        (0, 0, 0, 0),
        (0, 1, 0, 1),
        (1, 0, 0, 2),
        (1, 1, 0, 3),
        (2, 0, 1, 0),
        (2, 1, 1, 1),
        (3, 0, 1, 2),
        (3, 1, 1, 3),
    ]
    for node in (0, 1):  # no two ranks of a node share a GPU
        gpus = [s.gpu for s in slots if s.node == node]
        assert sorted(gpus) == [0, 1, 2, 3]
    local = rank_slots(cfg, local=True)  # the local launcher: all ranks on this machine
    assert [s.gpu for s in local] == list(range(8))


class _Queue:
    def __init__(self) -> None:
        self.items = []

    def put(self, item) -> None:
        self.items.append(item)


def test_local_rank_bootstrap_binds_the_global_rank_gpu(monkeypatch, tmp_path):
    """slurm/launchers/processes.py: rank 3 of 4 as replica 1's rank 1 sits on GPU 3, and NCCL gets device_id."""
    import torch.distributed as dist

    from slurm.launchers import processes as local

    cuda = FakeCuda(monkeypatch, 4)
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV, raising=False)
    clean_nccl_environment(monkeypatch, tmp_path)
    calls = {}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.update(args=a, kwargs=k))
    monkeypatch.setattr(dist, "is_initialized", lambda: "args" in calls)
    monkeypatch.setattr(dist, "get_backend", lambda *a: calls["args"][0])
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.update(destroyed=True))
    monkeypatch.setattr(local, "die_with_parent", lambda: None)
    monkeypatch.setattr(local, "redirect_output", lambda log: None)
    seen = {}

    def target(rank, size, events, *args):
        seen.update(rank=rank, size=size, device=rank_mod.current_device(), replica=events.replica)
        return "ok"

    q = _Queue()
    beats = [0.0] * 4  # the heartbeat slots (a shared array in real runs)
    local._bootstrap(3, 4, 2, str(tmp_path), "cuda", 1800.0, 1, tmp_path / "out" / "logs", q, beats, target, ())
    ((kind, rank, payload),) = q.items
    assert (kind, rank, pickle.loads(payload)) == ("result", 3, "ok")  # results travel by value
    assert cuda.current == 3 and seen == {"rank": 1, "size": 2, "device": torch.device("cuda", 3), "replica": 1}
    assert calls["args"] == ("nccl",) and calls["kwargs"]["device_id"] == torch.device("cuda", 3)
    assert calls["kwargs"]["timeout"].total_seconds() == 1800.0 and calls["kwargs"]["rank"] == 1
    assert calls["destroyed"]  # on success only
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3" and os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    (dump,) = [k for k in rank_mod.nccl_environment(tmp_path) if k.endswith("TEMP_FILE")]
    assert os.environ[dump].startswith(str(tmp_path / "out" / "logs" / "nccl-trace-rank-"))


class _DistEnv:
    def __init__(self, rank, local_rank, world) -> None:
        self.rank, self.local_rank, self.world_size, self.master_port = rank, local_rank, world, 29500

    def export(self, **kwargs):
        return self


class _JobEnv:
    hostnames = ["gpu-a", "gpu-b"]
    hostname = "gpu-b"
    num_nodes = 2
    node = 0


def test_slurm_task_binds_its_local_gpu_and_never_destroys_on_error(monkeypatch, tmp_path):
    """slurm/launchers/sbatch.py: task 6 of 2 nodes x 4 (replicas of 2) is replica 3's rank 0 on GPU 2;
    on an error it arms the exit deadline and does not call destroy_process_group."""
    import submitit
    import torch.distributed as dist

    from slurm.launchers import sbatch as submit

    cuda = FakeCuda(monkeypatch, 4)
    monkeypatch.delenv(rank_mod.RANK_DEVICE_ENV, raising=False)
    clean_nccl_environment(monkeypatch, tmp_path)
    monkeypatch.setattr(submitit.helpers, "TorchDistributedEnvironment", lambda: _DistEnv(6, 2, 8))
    monkeypatch.setattr(submitit, "JobEnvironment", _JobEnv)
    monkeypatch.setenv("MASTER_PORT", "29500")  # as the rank would pick it; removed after the test
    calls = {"destroyed": 0, "deadline": 0}
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: calls.update(args=a, kwargs=k))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: calls.__setitem__("destroyed", calls["destroyed"] + 1))
    monkeypatch.setattr(submit, "exit_soon", lambda: calls.__setitem__("deadline", calls["deadline"] + 1))
    monkeypatch.setattr(submit, "choose_gloo_interface", lambda peers: calls.__setitem__("gloo_peers", peers))

    def failing_run(cfg, task, tasks, decided, global_rank, rank, size, replica, device):
        calls.update(run=(global_rank, rank, size, replica, device))
        raise RuntimeError("boom")

    monkeypatch.setattr(submit.SlurmRun, "_run", staticmethod(failing_run))
    cfg = two_nodes_four_replicas(tmp_path / "out", timeout_s=30.0, setup_timeout_s=900.0)
    with pytest.raises(RuntimeError, match="boom"):
        submit.SlurmRun()(cfg, 0, 1, None, tmp_path / "beats")
    assert list((tmp_path / "beats").iterdir()) == []  # its heartbeat file goes with it
    assert cuda.current == 2 and calls["run"] == (6, 0, 2, 3, torch.device("cuda", 2))
    kwargs = calls["kwargs"]
    assert calls["args"] == ("nccl",) and kwargs["device_id"] == torch.device("cuda", 2)
    assert kwargs["rank"] == 0 and kwargs["world_size"] == 2 and kwargs["init_method"] == "tcp://gpu-b:29504"
    assert kwargs["timeout"].total_seconds() == 900.0  # setup timeout; per-step groups get 30 s
    assert calls["destroyed"] == 0 and calls["deadline"] == 1
    assert calls["gloo_peers"] == ["gpu-a"]  # gloo's interface chosen towards the other node
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


def test_exit_soon_arms_a_kernel_level_deadline(monkeypatch):
    import signal

    armed = {}
    monkeypatch.setattr(signal, "alarm", lambda s: armed.setdefault("s", s))
    monkeypatch.setattr(signal, "signal", lambda sig, handler: armed.setdefault("handler", (sig, handler)))
    rank_mod.exit_soon(12)
    assert armed == {"handler": (signal.SIGALRM, signal.SIG_DFL), "s": 12}


def test_user_nccl_settings_win(monkeypatch, tmp_path):
    clean_nccl_environment(monkeypatch, tmp_path)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    applied = rank_mod.apply_environment(tmp_path)
    assert applied["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1" and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert (tmp_path / "logs").is_dir()


def test_a_broken_flash_attn_falls_back_with_a_warning(monkeypatch):
    """A flash-attn built for another torch/CUDA fails to import with OSError or RuntimeError,
    not ImportError: `auto` must fall back to torch (with a warning), not end the run."""
    import builtins

    from runtime import kernels

    real_import = builtins.__import__

    def broken(name, *args, **kwargs):
        if name == "flash_attn":
            raise OSError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", broken)
    kernels.flash_attn_available.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="flash-attn is installed but does not load .*undefined symbol"):
            assert kernels.resolve_backend("auto", torch.device("cuda", 0), torch.bfloat16) == "sdpa"
        with pytest.raises(ConfigError, match="not installed or does not load"):
            kernels.resolve_backend("flash", torch.device("cuda", 0), torch.bfloat16)
    finally:
        kernels.flash_attn_available.cache_clear()


# -- the attention kernel (--attention) ---------------------------------------------------------


def _fa3_math(q, k, v, softmax_scale):
    """What FlashAttention-3 computes: out in q's dtype, lse [B, H, S] float32."""
    from runtime.kernels import reference_attention

    out_BSHD, lse_BSH = reference_attention(q, k, v, softmax_scale)
    return out_BSHD.to(q.dtype), lse_BSH.transpose(1, 2).float().contiguous()


def fa3_module(convention: str):
    """A `flash_attn_interface` returning as one of its builds did (runtime/kernels.py `_flash3_call`):
    "flag" from 2025-08-29, "pair" 2024-07 to 2025-05, "out" 2025-07 to 2025-08 (the lse only from its
    `_flash_attn_forward`), "bare" out only and no such forward."""
    import types

    module = types.ModuleType("flash_attn_interface")
    if convention == "flag":

        def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_attn_probs=False):
            out, lse = _fa3_math(q, k, v, softmax_scale)
            return (out, lse) if return_attn_probs else out

    elif convention == "pair":

        def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
            return _fa3_math(q, k, v, softmax_scale)

    else:

        def flash_attn_func(q, k, v, softmax_scale=None, causal=False):
            return _fa3_math(q, k, v, softmax_scale)[0]

    if convention == "out":

        def _flash_attn_forward(q, k, v, k_new, v_new, qv, out, cu_seqlens_q, softmax_scale, causal, num_splits=1):
            assert k_new is None and out is None and cu_seqlens_q is None and causal is False
            return (*_fa3_math(q, k, v, softmax_scale), None)

        module._flash_attn_forward = _flash_attn_forward
    module.flash_attn_func = flash_attn_func
    return module


@pytest.fixture
def fake_gpu(monkeypatch):
    """`gpu(capability, flash, flash3)`: this process sees a CUDA GPU of that compute capability,
    flash-attn importable or not, and `flash3` as flash_attn_interface (None: not installed)."""
    from runtime import kernels

    def gpu(capability: tuple[int, int], flash: bool = False, flash3=None) -> None:
        import types

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn") if flash else None)
        monkeypatch.setitem(sys.modules, "flash_attn_interface", flash3)
        kernels.flash_attn_available.cache_clear()
        kernels.flash3_available.cache_clear()

    yield gpu
    kernels.flash_attn_available.cache_clear()
    kernels.flash3_available.cache_clear()


def resolve(name: str, dtype=torch.bfloat16, device="cuda", **kwargs) -> str:
    from runtime.kernels import resolve_backend

    return resolve_backend(name, torch.device(device, 0), dtype, **kwargs)


def test_auto_takes_flash3_on_hopper_else_flash_else_sdpa(fake_gpu):
    fake_gpu((9, 0), flash=True, flash3=fa3_module("flag"))
    assert resolve("auto") == "flash3" and resolve("auto", torch.float16) == "flash3"
    assert resolve("auto", torch.float32) == "sdpa" and resolve("auto", device="cpu") == "sdpa"
    fake_gpu((9, 0), flash=True)  # Hopper without FlashAttention-3
    assert resolve("auto") == "flash"
    fake_gpu((8, 0), flash=True, flash3=fa3_module("flag"))  # Ampere: FlashAttention-3 does not run
    assert resolve("auto") == "flash"
    fake_gpu((8, 0))
    assert resolve("auto") == "sdpa" and resolve("sdpa") == "sdpa" and resolve("torch") == "sdpa"


@pytest.mark.parametrize(
    ("gpu", "name", "dtype", "device", "needle"),
    [
        ((9, 0), "flash3", torch.bfloat16, "cpu", "--attention flash3 needs CUDA; use sdpa (or auto) on CPU"),
        ((9, 0), "flash3", torch.float32, "cuda", "--attention flash3 needs --dtype bfloat16 or float16"),
        (
            (8, 6),
            "flash3",
            torch.bfloat16,
            "cuda",
            "flash3 needs a Hopper GPU (compute capability 9.x), this GPU is 8.6",
        ),
        ((9, 0), "flash", torch.bfloat16, "cuda", "--attention flash needs flash-attn, which is not installed"),
        ((8, 0), "flash", torch.float16, "cpu", "--attention flash needs CUDA"),
    ],
)
def test_an_explicit_kernel_that_cannot_run_is_refused_in_one_line(fake_gpu, gpu, name, dtype, device, needle):
    fake_gpu(gpu, flash3=fa3_module("flag"))
    with pytest.raises(ConfigError, match=re.escape(needle)) as refused:
        resolve(name, dtype, device)
    assert "\n" not in str(refused.value)


def test_flash3_not_installed_is_refused_but_passes_for_ranks_elsewhere(fake_gpu):
    fake_gpu((9, 0))
    with pytest.raises(ConfigError, match="needs FlashAttention-3, which is not installed or does not load"):
        resolve("flash3")
    fake_gpu((8, 0))  # a Slurm job's GPUs and packages are not this machine's
    assert resolve("flash3", check_installed=False) == "flash3"


@pytest.mark.parametrize("convention", ["flag", "pair", "out"])
def test_flash3_kernel_gives_out_and_lse_whatever_its_build_returns(monkeypatch, convention):
    """FlashAttention-3's flash_attn_func returned (out, lse), then out only, then out or (out, lse)
    by return_attn_probs: each build gives the state (out_BSHD, lse_BSH) and the output."""
    from runtime import kernels

    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3_module(convention))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 3, 8, generator=g) for n in (5, 7, 7))
    ref_out, ref_lse = kernels.reference_attention(q, k, v, 0.3)
    state = kernels.attention(q, k, v, 0.3, "flash3")
    assert state.lse_BSH.shape == (2, 5, 3) and state.out_BSHD.shape == (2, 5, 3, 8)
    torch.testing.assert_close(state.out_BSHD, ref_out.float())
    torch.testing.assert_close(state.lse_BSH, ref_lse.float())
    torch.testing.assert_close(kernels.attention_output(q, k, v, 0.3, "flash3"), ref_out.float())


def test_a_flash3_build_without_lse_is_named(monkeypatch):
    from runtime import kernels

    monkeypatch.setitem(sys.modules, "flash_attn_interface", fa3_module("bare"))
    q = torch.randn(1, 4, 2, 8)
    with pytest.raises(RuntimeError, match="returns no softmax_lse; update it"):
        kernels.attention(q, q, q, 0.3, "flash3")


def test_one_rank_takes_only_what_diffusers_dispatch_runs(fake_gpu, monkeypatch):
    """One rank runs diffusers' attention: it finds FlashAttention-3 as the package flash_attn_3
    and passes return_attn_probs (builds from 2025-08-29 on)."""
    from diffusers.models import attention_dispatch

    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN", True)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", True)
    fake_gpu((9, 0), flash=True, flash3=fa3_module("flag"))
    assert resolve("auto", one_rank=True) == "flash3" == resolve("flash3", one_rank=True)
    fake_gpu((9, 0), flash=True, flash3=fa3_module("pair"))
    assert resolve("auto") == "flash3" and resolve("auto", one_rank=True) == "flash"
    with pytest.raises(ConfigError, match="needs a FlashAttention-3 build from 2025-08-29 on"):
        resolve("flash3", one_rank=True)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", False)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN", False)
    assert resolve("auto", one_rank=True) == "sdpa"
    with pytest.raises(ConfigError, match="finds no package flash_attn_3"):
        resolve("flash3", one_rank=True)
    with pytest.raises(ConfigError, match=r"needs flash-attn >= 2\.6\.3"):
        resolve("flash", one_rank=True)
    with pytest.raises(ConfigError, match="reference is for a parallel strategy"):
        resolve("reference", one_rank=True)


def test_one_rank_of_a_model_that_masks_its_attention_runs_sdpa(fake_gpu, monkeypatch):
    """diffusers' flash-attn backends refuse an attention mask ("`attn_mask` is not supported"):
    HunyuanVideo's transformer passes its text padding as one, Wan's passes none."""
    from diffusers.models import attention_dispatch

    from runtime.kernels import passes_attention_mask

    assert passes_attention_mask("hunyuanvideo") and not passes_attention_mask("wan")
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN", True)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_FLASH_ATTN_3", True)
    fake_gpu((9, 0), flash=True, flash3=fa3_module("flag"))
    assert resolve("auto", one_rank=True, masked=True) == "sdpa"
    assert resolve("auto", masked=True) == "flash3"  # a parallel strategy: our kernels, no mask
    with pytest.raises(ConfigError, match="take no attention mask, and this model passes one"):
        resolve("flash", one_rank=True, masked=True)


def test_one_rank_sets_diffusers_attention_backend(parity_components):
    from diffusers.models.attention_dispatch import AttentionBackendName

    from runtime.kernels import DIFFUSERS_NAMES, use_on_one_rank

    assert set(DIFFUSERS_NAMES.values()) <= {b.value for b in AttentionBackendName}

    class Recorder(torch.nn.Module):
        def set_attention_backend(self, name: str) -> None:
            self.name = name

    recorder = Recorder()
    use_on_one_rank([recorder, torch.nn.Linear(1, 1)], "flash3")  # a module without it is left alone
    assert recorder.name == "_flash_3"
    transformer = parity_components["transformer"]
    use_on_one_rank([transformer], "sdpa")
    processors = [
        m.processor for m in transformer.modules() if hasattr(getattr(m, "processor", None), "_attention_backend")
    ]
    assert processors and all(p._attention_backend == AttentionBackendName.NATIVE for p in processors)


def test_gloo_binds_to_the_interface_the_nodes_share(monkeypatch):
    """Bug: on several nodes gloo (the CPU backend, and GPU runs' control group) bound to what
    the host name resolves to, often 127.0.1.1, which the other nodes cannot reach: the run hung
    until the setup timeout. The interface towards a peer is set as GLOO_SOCKET_IFNAME."""
    import socket

    monkeypatch.delenv(rank_mod.GLOO_IFNAME_ENV, raising=False)
    addresses = {"node-b": "10.9.8.7", "node-c": "127.0.0.1", "this-host": "127.0.1.1"}

    def resolve(name):
        if name not in addresses:
            raise socket.gaierror("unknown host")
        return addresses[name]

    monkeypatch.setattr(socket, "gethostbyname", resolve)
    monkeypatch.setattr(socket, "gethostname", lambda: "this-host")
    # The route to the remote peer leaves through one of this machine's interfaces.
    held = rank_mod.interface_addresses()
    own = next((name for name in held if name != "lo"), "lo")
    monkeypatch.setattr(rank_mod, "local_address_towards", lambda address: held[own])
    # Peers on this host need nothing; an unknown one is skipped; a remote one picks the interface.
    assert rank_mod.choose_gloo_interface(["node-c", "nowhere"]) is None
    assert rank_mod.GLOO_IFNAME_ENV not in os.environ
    assert rank_mod.choose_gloo_interface(["nowhere", "node-b"]) == own
    assert os.environ[rank_mod.GLOO_IFNAME_ENV] == own
    # The user's choice stands.
    monkeypatch.setenv(rank_mod.GLOO_IFNAME_ENV, "ib0")
    assert rank_mod.choose_gloo_interface(["node-b"]) is None and os.environ[rank_mod.GLOO_IFNAME_ENV] == "ib0"
    # No interface for the route, and this host's name is loopback: one line naming the fix.
    monkeypatch.delenv(rank_mod.GLOO_IFNAME_ENV)
    monkeypatch.setattr(rank_mod, "interface_of", lambda address: None)
    with pytest.raises(ConfigError, match=r"resolves to 127\.0\.1\.1, which node node-b \(10\.9\.8\.7\) cannot reach"):
        rank_mod.choose_gloo_interface(["node-b"])


def test_gloo_interface_choice_survives_a_peer_without_a_route(monkeypatch):
    import socket

    monkeypatch.delenv(rank_mod.GLOO_IFNAME_ENV, raising=False)
    monkeypatch.setattr(socket, "gethostbyname", lambda name: "10.9.8.7")

    def unreachable(address):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(rank_mod, "local_address_towards", unreachable)
    assert rank_mod.choose_gloo_interface(["node-b"]) is None and rank_mod.GLOO_IFNAME_ENV not in os.environ
