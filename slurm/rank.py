"""One rank's bring-up, the same for every launcher (local processes, srun steps, sbatch jobs).

In order: the environment NCCL reads (`rank_environment`), the rank's own GPU made current
(`select_device`), the process group joined with that device bound (`join`), and, on an
error, an exit that cannot hang (`exit_soon`). The mesh and its communicators come after
(`runtime.mesh.build_mesh`, which creates every communicator eagerly).

Why each piece (docs/ALGORITHMS.md section 6): under NCCL a rank whose peer died does not fail
fast as under gloo: it spins in the collective until the watchdog's timeout, and then the
process aborts without running Python `finally` blocks. So a failing rank must exit
promptly and non-zero (the launcher, or srun's `--kill-on-bad-exit`, then stops its peers),
and it must not call `destroy_process_group()` on the way out: since torch 2.6 that waits for
in-flight work and can block forever when a peer is gone.
"""

from __future__ import annotations

import ipaddress
import os
import random
import signal
import socket
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from basics.errors import ConfigError
from basics.user_files import digits

# The device ranks compute on, overriding the run's: "cpu" lets a job that asked Slurm for
# GPUs compute on CPUs (the GPU request path tested on a cluster without GPUs); "cuda" insists.
RANK_DEVICE_ENV = "DITANGO_RANK_DEVICE"
# How long a failing rank may take to exit before the kernel ends it (SIGALRM).
EXIT_DEADLINE_S = 30

# What a launcher that starts the ranks itself sets in each one (torchrun, Kubernetes'
# PyTorchJob and JobSet, MPI wrappers that export them): `ditango generate` then runs as
# that rank (slurm/launchers/env.py).
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class LaunchedRank:
    """This process as a launcher started it: its global and local rank, the world's size, the
    node it is on (torchrun's GROUP_RANK, else this host's name), the ranks on its node
    (LOCAL_WORLD_SIZE; 0: not said), and torchrun's run id and restart count (a restart is a
    later launch of the same run)."""

    rank: int
    world_size: int
    local_rank: int
    node: str
    local_size: int = 0
    restart: int = 0
    run_id: str = ""

    @property
    def writer(self) -> bool:
        return self.rank == 0


def launcher_number(
    environ, name: str, what: str, least: int = 0, most: int = 2**31 - 1, required: bool = False
) -> int | None:
    """The whole number in `least`..`most` a launcher variable holds, None when it is unset or
    empty and not `required`; a one-line ConfigError naming the variable otherwise. Every
    launcher variable that holds a number is read here."""
    raw = environ.get(name)
    if (raw is None or not raw.strip()) and not required:
        return None
    value = digits(raw)
    if value is None or not least <= value <= most:
        raise ConfigError(f"{name}={raw!r} (set by the launcher) is not {what}")
    return value


def launched_rank(environ=os.environ) -> LaunchedRank | None:
    """This process's place when a launcher started it with LAUNCHER_VARIABLES (all of them),
    else None. A value of the wrong kind (a rank that is no number, a port out of range, an
    address with spaces) is a ConfigError naming the variable: torch would fail on it later,
    with a message that names neither."""
    missing = [name for name in LAUNCHER_VARIABLES if not environ.get(name)]
    if missing:
        world = digits(environ.get("WORLD_SIZE"))
        if environ.get("RANK") and world is not None and world > 1:  # a launcher's ranks, half described
            raise ConfigError(
                f"RANK and WORLD_SIZE={world} are set, {', '.join(missing)} not: a launcher's rank "
                "needs all of " + ", ".join(LAUNCHER_VARIABLES)
            )
        return None
    rank, world, local = (
        launcher_number(environ, n, "a rank number", required=True) for n in ("RANK", "WORLD_SIZE", "LOCAL_RANK")
    )
    if world < 1 or rank >= world:
        raise ConfigError(f"RANK={rank} is not below WORLD_SIZE={world} (set by the launcher)")
    launcher_number(environ, "MASTER_PORT", "a port number (1-65535)", 1, 65535, required=True)
    address = environ["MASTER_ADDR"]
    if not address.strip() or any(c.isspace() or not c.isprintable() for c in address):
        raise ConfigError(f"MASTER_ADDR={address!r} (set by the launcher) is not a host name or address")
    node = environ.get("GROUP_RANK") or socket.gethostname()
    local_size = (
        launcher_number(environ, "LOCAL_WORLD_SIZE", f"a number of ranks up to WORLD_SIZE={world}", 1, world) or 0
    )
    if local_size and local >= local_size:
        raise ConfigError(f"LOCAL_RANK={local} is not below LOCAL_WORLD_SIZE={local_size} (set by the launcher)")
    restart = launcher_number(environ, "TORCHELASTIC_RESTART_COUNT", "a restart count") or 0
    return LaunchedRank(rank, world, local, node, local_size, restart, environ.get("TORCHELASTIC_RUN_ID", ""))


def nccl_environment(log_dir: Path) -> dict[str, str]:
    """What NCCL ranks are given (each unless the user's environment already sets it)."""
    return {
        # A collective that fails or times out ends the process without aborting the
        # communicators first (3 = tear down, skip clean-up): the clean-up itself can hang on
        # a dead peer. This is torch's default since 2.2; set so that older ones agree.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
        # On a timeout, every rank writes what its collectives were doing (the flight
        # recorder) next to the rank logs: which rank was missing, in which collective.
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        **_flight_recorder(log_dir / "nccl-trace-rank-"),
    }


def _flight_recorder(prefix: Path) -> dict[str, str]:
    """The flight recorder's buffer and dump file, under the names this torch reads (renamed
    TORCH_FR_* by 2.11; the old names still work there, with a deprecation warning)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) >= (2, 11):
        return {"TORCH_FR_BUFFER_SIZE": "2000", "TORCH_FR_DUMP_TEMP_FILE": str(prefix)}
    return {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(prefix)}


def rank_environment(out_dir: Path) -> dict[str, str]:
    """The environment every rank of a run gets (set before the process group exists)."""
    return nccl_environment(log_dir(out_dir))


def rendezvous_port(seed: str, span: int = 64) -> int:
    """The first of `span` ports for a job's rendezvous (its store; one more per replica), drawn
    from `seed` (the job or step id: the same on every rank) below the kernel's ephemeral range,
    where a port the kernel hands out to some connection cannot already hold it (submitit draws
    from 20000-60000, which the default ephemeral range 32768-60999 overlaps: a retried srun step
    once found its port in use)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    top = max(low - span, 10000 + span)
    return random.Random(seed).randint(10000, top)


def log_dir(out_dir: Path) -> Path:
    return out_dir / "logs"


def apply_environment(out_dir: Path) -> dict[str, str]:
    """Set `rank_environment` in this process (the user's own values win); returns what applies."""
    applied = {key: os.environ.setdefault(key, value) for key, value in rank_environment(out_dir).items()}
    log_dir(out_dir).mkdir(parents=True, exist_ok=True)
    return applied


def device_intent(device: str) -> str:
    """The run's device ("auto", "cpu" or "cuda"), unless RANK_DEVICE_ENV overrides it here."""
    override = os.environ.get(RANK_DEVICE_ENV)
    if not override:
        return device
    if override not in ("cpu", "cuda"):
        raise ConfigError(f"{RANK_DEVICE_ENV} must be cpu or cuda, got {override!r}")
    return override


def select_device(device: str, local_rank: int, local_size: int = 0) -> torch.device:
    """The device of the rank with `local_rank` on this node, made current.

    "cuda" (what a Slurm submission asks for unless --device cpu) insists on a GPU: a node
    without one is an error, never a silent CPU run. "auto" takes a GPU when one is visible.
    Rank i of a node takes GPU i; a node that shows each task only its own GPU (Slurm's
    per-task binding) gives every rank GPU 0. `local_size`: the ranks a launcher that binds
    nothing (torchrun) started on this node, each of which must see a GPU of its own.
    """
    device = device_intent(device)
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if not (torch.version.cuda or torch.version.hip):  # the build, not the node, is the problem
            raise ConfigError(
                f"this run asked for GPUs, but the torch on {socket.gethostname()} ({torch.__version__}) is a "
                "CPU-only build; install a CUDA build (./scripts/setup.sh --cuda), or run with --device cpu"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise ConfigError(
            f"this run asked for GPUs, but {socket.gethostname()} has no CUDA device that torch can use "
            f"(CUDA_VISIBLE_DEVICES={visible}); request GPUs on this partition, or run with --device cpu"
        )
    count = torch.cuda.device_count()
    if local_size > count:
        raise ConfigError(
            f"the launcher started {local_size} ranks on {socket.gethostname()} (LOCAL_WORLD_SIZE), but {count} GPU(s) "
            "are visible: they would share one; start at most one rank per GPU (torchrun --nproc-per-node)"
        )
    if count == 1:
        index = 0
    elif local_rank < count:
        index = local_rank
    else:
        raise ConfigError(
            f"local rank {local_rank} on {socket.gethostname()} has no GPU of its own: {count} are visible; "
            "use --gpus-per-node <= the GPUs of a node"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def current_device() -> torch.device:
    """The device this rank's process group is bound to (after `join`)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"


def choose_gloo_interface(peers: list[str]) -> str | None:
    """Before a multi-node process group: the network interface gloo is to use (the CPU ranks'
    backend, and the control group of GPU runs), set as GLOO_SOCKET_IFNAME unless the user set
    it. Without it gloo binds to what this host's name resolves to, often 127.0.1.1 (Debian's
    /etc/hosts), which the other nodes cannot reach: the run hung until the setup timeout.
    The interface is the one this host reaches its first resolvable non-loopback peer through;
    peers that are loopback addresses (every node on this one host) need none. A host whose
    route to a peer has no named interface, and whose name resolves to loopback, is refused in
    one line. Returns the interface set, if any."""
    if os.environ.get(GLOO_IFNAME_ENV):
        return None
    for peer in peers:
        try:
            address = socket.gethostbyname(peer)
        except OSError:
            continue
        if ipaddress.ip_address(address).is_loopback:
            continue  # that node is this host
        try:
            name = interface_of(local_address_towards(address))
            own = socket.gethostbyname(socket.gethostname())
        except OSError:  # no route to it, or no address for this host: gloo says so itself
            continue
        if name is not None:
            os.environ[GLOO_IFNAME_ENV] = name
            return name
        if ipaddress.ip_address(own).is_loopback:
            raise ConfigError(
                f"this node's name resolves to {own}, which node {peer} ({address}) cannot reach, and no "
                f"interface was found for the route to it: set {GLOO_IFNAME_ENV} (and NCCL_SOCKET_IFNAME) "
                "to the network interface the nodes share, e.g. eth0 or ib0"
            )
        return None
    return None


def local_address_towards(address: str) -> str:
    """The IPv4 address this host sends from to `address` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((address, 9))
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address`, else None."""
    return next((name for name, held in interface_addresses().items() if held == address), None)


def interface_addresses() -> dict[str, str]:
    """{interface: its IPv4 address} of this host (Linux: SIOCGIFADDR; {} elsewhere)."""
    try:
        import fcntl
    except ImportError:
        return {}
    import struct

    SIOCGIFADDR = 0x8915
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address on it
                continue
            found[name] = socket.inet_ntoa(raw[20:24])
    return found


def join(device: torch.device, *, rank: int, world_size: int, timeout_s: float, init_method: str | None = None) -> None:
    """`init_process_group` for this rank. With NCCL the device is bound (`device_id`): the
    default communicator is created now, and `new_group` splits it instead of creating
    communicators lazily inside the first step. `timeout_s` is the setup timeout: the default
    group carries only bring-up collectives."""
    extra = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend_for(device),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **extra,
    )


def exit_soon(seconds: int = EXIT_DEADLINE_S) -> None:
    """On an error path: make sure this process is gone within `seconds`, whatever blocks its
    exit (a communicator torn down at interpreter exit while a peer is dead). SIGALRM's default
    action ends the process at the kernel level, which no stuck thread can delay."""
    if hasattr(signal, "alarm"):
        signal.signal(signal.SIGALRM, signal.SIG_DFL)
        signal.alarm(seconds)
