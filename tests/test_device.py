"""Device placement, on CPU: the placement function, the collectives' device check, the
refusal an NCCL group gives a CPU tensor (reproduced with a ``cuda:gloo`` group), and a
static check of the training and evaluation modules for the bug class that refusal is.

A CPU has one device, so a batch never moved or a flag made without ``device=`` runs here
and fails on the first GPU node. Three things stand in for the GPU: the ``meta`` device as
``device()`` (it is neither the host nor a GPU: whatever is not placed through
``cqk_megatron.parallel.device`` stays behind on the host and is caught), the ``cuda:gloo`` group,
and the source check (``tests/_device_rules.py``). The two-rank audit of a real run is in
``tests/test_gpu_path.py``.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from _device_rules import OWNER, SAMPLER, scan, scan_source

import cqk_megatron.parallel.device as placement
from cqk_megatron.training import collectives
from cqk_megatron.training.sampler import collate, fetch
from cqk_megatron.training.step_loss import global_mean_loss

REPO = Path(__file__).resolve().parents[1]
META = torch.device("meta")


# -- the placement function ------------------------------------------------------------


def test_device_is_the_cpu_without_cuda():
    assert not torch.cuda.is_available()
    assert placement.device() == torch.device("cpu")
    assert placement.bind() == torch.device("cpu")


@pytest.mark.parametrize(
    ("env", "gpus", "expected"),
    [
        ({"LOCAL_RANK": "3"}, 8, 3),
        ({"LOCAL_RANK": "5"}, 4, 1),  # more ranks than GPUs on the node: wrap around
        ({"SLURM_LOCALID": "2"}, 8, 2),  # srun / submitit without torchrun
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "6"}, 8, 1),  # torchrun's variable wins
        ({"LOCAL_RANK": "7"}, 1, 0),  # one GPU per task through CUDA_VISIBLE_DEVICES
        ({}, 8, 0),
    ],
)
def test_device_is_cuda_local_rank_modulo_the_visible_gpus(monkeypatch, env, gpus, expected):
    # No GPU here: torch.cuda's two answers are replaced (the only mock in this file).
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert placement.device() == torch.device("cuda", expected)


def test_to_device_on_cpu_is_the_identity():
    batch = {"tokens": torch.arange(6).view(2, 3), "labels": torch.ones(2, 3)}
    assert placement.to_device(batch) is batch


def test_move_rebuilds_containers_and_moves_every_tensor():
    Pair = namedtuple("Pair", "a b")
    batch = {
        "tokens": torch.arange(6).view(2, 3),
        "nested": [torch.zeros(2), (torch.ones(1), "text")],
        "pair": Pair(torch.ones(2), 3),
        "count": 7,
    }
    moved = placement.move(batch, META, pin=False)
    assert moved["tokens"].device == META and moved["tokens"].shape == (2, 3)
    assert moved["tokens"].dtype == torch.int64
    assert moved["nested"][0].device == META and moved["nested"][1][0].device == META
    assert moved["nested"][1][1] == "text" and isinstance(moved["nested"][1], tuple)
    assert isinstance(moved["pair"], Pair) and moved["pair"].a.device == META
    assert moved["count"] == 7
    assert batch["tokens"].device.type == "cpu"  # the host batch is left as it was


def test_move_pins_host_tensors_when_asked(monkeypatch):
    # Pinning needs a CUDA driver: the call is recorded instead (a mock, said so).
    pinned = []

    def pin_memory(self):
        pinned.append(self.shape)
        return self

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    moved = placement.move({"a": torch.ones(2), "b": torch.zeros(3, 1)}, META, pin=True)
    assert sorted(pinned) == [(2,), (3, 1)]
    assert moved["a"].device == META and moved["b"].device == META


class _Samples:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> dict:
        tokens = torch.full((3,), index)
        return {"tokens": tokens, "labels": tokens + 1, "loss_mask": torch.ones(3)}


def test_fetch_puts_the_batch_on_the_device(monkeypatch):
    monkeypatch.setattr(placement, "device", lambda: META)
    batch = fetch(_Samples(), [0, 1, 5])
    assert {tensor.device for tensor in batch.values()} == {META}
    host = collate(_Samples(), [0, 1, 5])  # the fingerprint's host copy stays on the host
    assert host["tokens"][:, 0].tolist() == [0, 1, 1]  # 5 wraps around to 1
    assert {tensor.device.type for tensor in host.values()} == {"cpu"}


# -- the collectives' own check --------------------------------------------------------


def test_collectives_refuse_a_tensor_off_the_device_and_name_the_fix(monkeypatch):
    monkeypatch.setattr(collectives, "device", lambda: META)
    with pytest.raises(
        collectives.CollectiveDeviceError, match="device=cqk_megatron.parallel.device"
    ):
        collectives.all_reduce(torch.zeros(1))
    with pytest.raises(collectives.CollectiveDeviceError, match="on cpu"):
        global_mean_loss(torch.zeros(()), 1)  # the loss sum a CPU-only engine would hand in


CUDA_GLOO = """
import torch, torch.distributed as dist
from cqk_megatron.training import collectives
dist.init_process_group("cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    dist.all_reduce(torch.ones(1))
except RuntimeError as error:
    print("refused:", error)
try:
    collectives.any_rank(True)
except RuntimeError as error:
    print("refused:", error)
"""


def test_a_cuda_gloo_group_refuses_cpu_tensors_as_nccl_does():
    # An nccl group maps only the cuda device type to a backend; created as "cuda:gloo" on
    # CPU, a group does the same, so a CPU tensor in a collective fails here as on a GPU.
    result = subprocess.run(
        [sys.executable, "-c", CUDA_GLOO],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("refused:")]
    assert len(lines) == 2, result.stdout + result.stderr
    assert all("No backend type associated with device type cpu" in line for line in lines)


# -- the static check ------------------------------------------------------------------


def test_the_training_and_evaluation_modules_pass_the_static_check():
    assert [str(v) for v in scan(REPO)] == []


def _rules(source: str, path: str = "cqk_megatron/training/loop.py") -> list[str]:
    return [v.rule for v in scan_source(textwrap.dedent(source), path)]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\nflag = torch.tensor([1.0])\n",  # the old preemption flag
        "import torch\ncounts = torch.zeros(2, dtype=torch.float64)\n",  # the old counts
        "import torch as t\nx = t.arange(4)\n",
    ],
)
def test_a_factory_without_a_device_is_caught(source):
    assert _rules(source) == ["factory"]


def test_factories_that_name_a_device_pass():
    source = """
    import torch
    from cqk_megatron.parallel.device import device
    a = torch.zeros(2, device=device())
    b = torch.tensor(0.0, device="cpu")
    c = torch.zeros_like(a)
    """
    assert _rules(source) == []


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(x)\n",
        "import torch\ntorch.distributed.barrier()\n",
        "from torch import distributed\ndistributed.broadcast(x, 0)\n",
        "from torch.distributed import all_reduce as reduce_all\nreduce_all(x)\n",
    ],
)
def test_a_collective_outside_the_owning_module_is_caught(source):
    assert _rules(source) == ["collective"]
    assert _rules(source, OWNER) == []


def test_non_communicating_calls_pass():
    source = "import torch.distributed as dist\nrank = dist.get_rank()\ndist.is_initialized()\n"
    assert _rules(source) == []


@pytest.mark.parametrize(
    "source",
    [
        "x = batch.cuda()\n",
        "x = tokens.to(device)\n",  # the old MQAR path
        "x = tokens.to('cuda')\n",
        "x = tokens.to(device=here, non_blocking=True)\n",
        "from torch.utils.data import default_collate\nb = default_collate(items)\n",
    ],
)
def test_a_move_that_bypasses_the_placement_function_is_caught(source):
    assert _rules(source) == ["placement"]


def test_dtype_casts_and_host_copies_pass():
    source = """
    import torch
    a = x.to(torch.int64)
    b = x.to(y.dtype)
    c = x.to(dtype=torch.bfloat16)
    d = x.to("cpu")
    """
    assert _rules(source) == []


def test_a_sampler_whose_fetch_does_not_place_its_batch_is_caught():
    old = """
    from torch.utils.data import default_collate
    def fetch(dataset, indices):
        return default_collate([dataset[i] for i in indices])
    """
    new = """
    from torch.utils.data import default_collate
    from cqk_megatron.parallel.device import to_device
    def collate(dataset, indices):
        return default_collate([dataset[i] for i in indices])
    def fetch(dataset, indices):
        return to_device(collate(dataset, indices))
    """
    assert _rules(old, SAMPLER) == ["placement"]
    assert _rules(new, SAMPLER) == []
