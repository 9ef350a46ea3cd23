"""``cqk check``: can this install train? One command after an install, on a laptop or on
a cluster node.

It prints the versions that matter (Python, torch, megatron-core, DeepSpeed), whether
CUDA and NCCL are there and how many GPUs this process sees, whether the optional
Transformer Engine and Apex are installed, and whether a one-rank process group starts:
gloo on a CPU machine, NCCL on a GPU one, the collective library training would use
(``cqk_megatron.parallel.process_groups.collective_library``). It exits 0 when the install
can train and 1 otherwise, with one line per missing piece and the command that installs
it (docs/install.md has the full install).

The process group is started in a child process with a time limit, so a network setup that
hangs (a hostname that does not resolve for gloo, an NCCL that waits forever) ends the
check with a message instead of hanging it.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field

from cqk_megatron.cli.args import add_renamed

# torch >= 2.5 for scaled_dot_product_attention(enable_gqa=...) (setup.py says the same).
MIN_TORCH = (2, 5)
# The megatron-core minor this stack is written and tested against (compat/ and the
# engines reach into its internals); another minor gets a note, not a refusal.
TESTED_MEGATRON_MINOR = (0, 16)
INSTALL_DOC = "docs/install.md"

# Run in a child process: a one-rank process group on a TCP store of this host, one
# all_reduce on the library's device (gloo: CPU, NCCL: GPU 0), then torn down. Imports only torch.
PROBE_SOURCE = """
import datetime, sys
import torch
import torch.distributed as dist
library, timeout_s = sys.argv[1], float(sys.argv[2])
device = torch.device("cuda", 0) if library == "nccl" else torch.device("cpu")
if device.type == "cuda":
    torch.cuda.set_device(device)
timeout = datetime.timedelta(seconds=timeout_s)
store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
dist.init_process_group(library, store=store, rank=0, world_size=1, timeout=timeout)
value = torch.ones(1, device=device)
dist.all_reduce(value)
if device.type == "cuda":
    torch.cuda.synchronize()
assert value.item() == 1.0, value
dist.destroy_process_group()
print("ok")
"""


@dataclass(frozen=True)
class Package:
    """What importing one package gave: its version, or why it failed."""

    name: str
    version: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class GroupProbe:
    """Whether a one-rank process group on ``library`` (gloo or NCCL) started (and why
    not)."""

    library: str
    ok: bool
    detail: str


@dataclass
class Facts:
    """Everything the verdict is made from; gathered by ``gather`` or written by a test."""

    python: str
    torch: Package
    megatron: Package
    deepspeed: Package
    torch_cuda: str | None = None  # the CUDA version torch was built with (None: CPU build)
    cuda_available: bool = False
    device_count: int = 0
    device_name: str | None = None
    nccl: str | None = None  # NCCL's version, when torch has it
    nvidia_smi: bool = False  # this machine has NVIDIA's driver tools
    transformer_engine: str | None = None  # version if installed
    apex: str | None = None  # version (or "installed") if installed
    group: GroupProbe | None = None
    notes: list[str] = field(default_factory=list)


def _version_of(distribution: str, module: object) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return str(getattr(module, "__version__", "unknown"))


def import_package(name: str, module: str, distribution: str) -> Package:
    """Import ``module`` (its warnings about optional kernels hidden: this check reports
    Transformer Engine and Apex itself) and read its version."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            imported = importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure to import is the finding
        return Package(name, error=f"{type(error).__name__}: {error}")
    return Package(name, version=_version_of(distribution, imported))


def installed_version(module: str, distributions: tuple[str, ...]) -> str | None:
    """The version of an optional package, found without importing it (Transformer
    Engine's import alone takes seconds and initialises CUDA)."""
    if importlib.util.find_spec(module) is None:
        return None
    for distribution in distributions:
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed"


def probe_group(library: str, timeout_s: float) -> GroupProbe:
    """Start a one-rank process group on ``library`` (gloo or NCCL) in a child process,
    within ``timeout_s``."""
    started = time.monotonic()
    command = [sys.executable, "-c", PROBE_SOURCE, library, str(timeout_s)]
    try:
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=timeout_s + 30, check=False
        )
    except subprocess.TimeoutExpired:
        return GroupProbe(library, False, f"did not start within {timeout_s + 30:g} s")
    seconds = time.monotonic() - started
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return GroupProbe(library, True, f"started, all_reduce ok ({seconds:.1f} s)")
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    reason = lines[-1] if lines else f"exit code {done.returncode}"
    return GroupProbe(library, False, reason)


def gather(library: str = "auto", timeout_s: float = 60.0, start_group: bool = True) -> Facts:
    """This machine's facts. ``library='auto'`` probes what training would use."""
    facts = Facts(
        python=platform.python_version(),
        torch=import_package("torch", "torch", "torch"),
        megatron=Package("megatron-core", error="not checked: torch does not import"),
        deepspeed=Package("deepspeed", error="not checked: torch does not import"),
        nvidia_smi=shutil.which("nvidia-smi") is not None,
        transformer_engine=installed_version(
            "transformer_engine", ("transformer-engine", "transformer_engine")
        ),
        apex=installed_version("apex", ("apex",)),
    )
    if not facts.torch.ok:
        return facts
    import torch
    import torch.distributed as dist

    facts.torch_cuda = torch.version.cuda
    facts.cuda_available = torch.cuda.is_available()
    if facts.cuda_available:
        facts.device_count = torch.cuda.device_count()
        facts.device_name = torch.cuda.get_device_name(0)
    if dist.is_available() and dist.is_nccl_available() and facts.torch_cuda:
        facts.nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    # DeepSpeed picks its accelerator at import; say which, as the training engine does.
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if facts.cuda_available else "cpu")
    facts.megatron = import_package("megatron-core", "megatron.core", "megatron-core")
    facts.deepspeed = import_package("deepspeed", "deepspeed", "deepspeed")
    if start_group:
        chosen = library if library != "auto" else ("nccl" if facts.cuda_available else "gloo")
        if chosen == "nccl" and not facts.cuda_available:
            facts.group = GroupProbe("nccl", False, "NCCL needs a GPU and CUDA is not available")
        else:
            facts.group = probe_group(chosen, timeout_s)
    return facts


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def problems(facts: Facts) -> list[str]:
    """What keeps this install from training, one line each with its fix."""
    found: list[str] = []
    if not facts.torch.ok:
        found.append(
            f"torch does not import ({facts.torch.error}); install it first: on a laptop "
            "bash scripts/install.sh, on a GPU node the CUDA build of torch "
            f"({INSTALL_DOC})"
        )
        return found
    if _release(facts.torch.version or "0") < MIN_TORCH:
        found.append(
            f"torch {facts.torch.version} is older than "
            f"{'.'.join(map(str, MIN_TORCH))}; install a newer torch ({INSTALL_DOC})"
        )
    if facts.nvidia_smi and facts.torch_cuda is None:
        found.append(
            f"this machine has NVIDIA GPUs (nvidia-smi is here) but torch {facts.torch.version} "
            "is a CPU build: training would run on the CPU; install torch's CUDA build "
            f"({INSTALL_DOC}, 'On a CUDA cluster node')"
        )
    elif facts.torch_cuda and not facts.cuda_available and facts.nvidia_smi:
        found.append(
            f"torch is built for CUDA {facts.torch_cuda} but sees no GPU: check the driver "
            "(nvidia-smi) and CUDA_VISIBLE_DEVICES, or run on a GPU node"
        )
    if facts.cuda_available and not facts.nccl:
        found.append("CUDA is available but torch has no NCCL: install torch's CUDA build")
    if not facts.megatron.ok:
        found.append(
            f"megatron-core does not import ({facts.megatron.error}); "
            "pip install 'megatron-core>=0.16.1,<0.17'"
        )
    if not facts.deepspeed.ok:
        found.append(
            f"deepspeed does not import ({facts.deepspeed.error}); after torch: "
            "pip install --no-build-isolation deepspeed (or train with train.engine=megatron)"
        )
    if facts.group is not None and not facts.group.ok:
        hint = (
            "check that this host's name resolves (or set GLOO_SOCKET_IFNAME)"
            if facts.group.library == "gloo"
            else "check the driver, NCCL_* settings and CUDA_VISIBLE_DEVICES"
        )
        found.append(
            f"a one-rank {facts.group.library} process group did not start "
            f"({facts.group.detail}); {hint}"
        )
    return found


def notes(facts: Facts) -> list[str]:
    """What does not stop training but is worth knowing."""
    said = list(facts.notes)
    if facts.megatron.ok and _release(facts.megatron.version or "0") != TESTED_MEGATRON_MINOR:
        said.append(
            f"megatron-core {facts.megatron.version}: this stack is tested with "
            f"{'.'.join(map(str, TESTED_MEGATRON_MINOR))}.x"
        )
    if facts.cuda_available and facts.transformer_engine is None:
        said.append(
            "Transformer Engine is not installed: transformer_impl=transformer_engine is refused"
        )
    return said


def _package_line(package: Package) -> str:
    return package.version if package.ok else f"MISSING ({package.error})"


def report_lines(facts: Facts) -> list[str]:
    """The table ``cqk check`` prints, one fact a line."""
    torch = _package_line(facts.torch)
    if facts.torch.ok:
        torch += " (CPU build)" if facts.torch_cuda is None else f" (CUDA {facts.torch_cuda} build)"
    if facts.cuda_available:
        cuda = f"available: {facts.device_count} GPU(s) visible ({facts.device_name})"
    else:
        cuda = "not available (training runs on CPU with gloo)"
    rows = [
        ("python", facts.python),
        ("torch", torch),
        ("megatron-core", _package_line(facts.megatron)),
        ("deepspeed", _package_line(facts.deepspeed)),
        ("CUDA", cuda),
        ("NCCL", facts.nccl or "not available"),
        ("Transformer Engine", facts.transformer_engine or "not installed (optional)"),
        ("Apex", facts.apex or "not installed (optional)"),
    ]
    if facts.group is not None:
        state = facts.group.detail if facts.group.ok else f"FAILED: {facts.group.detail}"
        rows.append((f"{facts.group.library} group", f"one rank: {state}"))
    return [f"  {name:<19} {value}" for name, value in rows]


def verdict(facts: Facts) -> tuple[int, list[str]]:
    """The exit code and the closing lines: 0 when this install can train, else 1."""
    missing = problems(facts)
    lines = [f"note: {note}" for note in notes(facts)]
    if missing:
        lines.append(f"this install cannot train yet ({len(missing)} problem(s)):")
        lines.extend(f"  - {line}" for line in missing)
        return 1, lines
    where = f"{facts.device_count} GPU(s), NCCL" if facts.cuda_available else "CPU, gloo"
    checked = "" if facts.group is not None else " (process group not started: --no-group)"
    lines.append(f"this install can train ({where}){checked}")
    return 0, lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cqk check",
        description=(
            "Check that this install can train: versions of Python, torch, megatron-core "
            "and DeepSpeed, CUDA/NCCL and the GPUs visible, Transformer Engine and Apex, "
            "and a one-rank process group. Exit 0 when it can train, else 1 naming what "
            "is missing."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_renamed(
        parser,
        "--collectives",
        ("--backend",),
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="collective library of the process group to start: auto is nccl where CUDA is "
        "available, else gloo (what training uses)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds the process group may take to start before the check fails",
    )
    parser.add_argument(
        "--no-group",
        action="store_true",
        help="skip starting a process group (versions and devices only)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    facts = gather(args.collectives, args.timeout, start_group=not args.no_group)
    print("cqk check: can this install train?")
    for line in report_lines(facts):
        print(line)
    code, closing = verdict(facts)
    for line in closing:
        print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
