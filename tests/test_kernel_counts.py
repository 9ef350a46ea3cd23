"""Kernels per attention block of each variant, at the 1B head shape (16 heads of 128, an
8-token sequence): the numbers in docs/performance.md ("Kernels per attention block").

A kernel here is an aten operator that computes (views, allocations and detaches
excluded), counted by a dispatch mode below autograd, in one block's forward and in its
backward, on CPU and eagerly: on GPU each is about one kernel launch. The coupling's
compiled form is counted from inductor's generated code (its fused kernels and its
calls of external matmuls); compiling at this shape takes minutes on a small CPU, so
that count is not a test but ``python tests/test_kernel_counts.py``, which prints both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from _tiny import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "performance.md"
VARIANTS = (
    "standard",
    "coupled",
    "coupled_euler",
    "mlp_only",
    "invertible",
    "differential",
    "coupled_differential",
    "invertible_differential",
)
SEQ = 8
_ATEN = torch.ops.aten
_NO_KERNEL = {
    _ATEN.detach.default,
    _ATEN.empty.memory_format,
    _ATEN.empty_strided.default,
    _ATEN.empty_like.default,
    _ATEN.new_empty.default,
    _ATEN.new_empty_strided.default,
    _ATEN.lift_fresh.default,
    _ATEN._unsafe_view.default,
}


class KernelCounter(TorchDispatchMode):
    """The operators that compute a tensor, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        computes = not func.is_view and func not in _NO_KERNEL
        if computes and any(isinstance(t, torch.Tensor) for t in _flat(out)):
            self.ops[func.overloadpacket.__name__] += 1
        return out

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def _flat(out) -> list:
    return list(out) if isinstance(out, tuple | list) else [out]


def block_kernels(variant: str) -> tuple[int, int]:
    """(forward, backward) kernels of one self-attention block of ``variant`` at the 1B
    head shape, fp32, RoPE applied, as the layer's default runs it on CPU."""
    config = tiny_config(
        variant,
        "model.ffn_hidden_size=64",  # the MLP is not counted: keep the build small
        vocab=128,
        layers=1,
        hidden=2048,
        heads=16,
        kv_heads=16,
        seq=SEQ,
        precision="fp32",
    )
    torch.manual_seed(0)
    model = build_model(config)
    attention = model.decoder.layers[0].self_attention
    rotary = model.rotary_pos_emb(SEQ)
    hidden = torch.randn(SEQ, 1, config.model.hidden_size, requires_grad=True)
    with KernelCounter() as forward:
        out, _ = attention(hidden, None, rotary_pos_emb=rotary)
    grad = torch.randn_like(out)
    with KernelCounter() as backward:
        out.backward(grad)
    return forward.total, backward.total


def documented_counts() -> dict[str, tuple[int, int]]:
    """The eager (forward, backward) columns of the docs' table, by variant."""
    section = DOCS.read_text().split("## Kernels per attention block", 1)[1].split("\n## ")[0]
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \|", section, re.M)
    return {name: (int(fwd), int(bwd)) for name, fwd, bwd in rows}


@pytest.fixture(scope="module")
def counted_kernels() -> dict[str, tuple[int, int]]:
    """Every variant's counts, taken in a fresh process: what earlier tests of a worker
    leave behind (compiled graphs, process groups, global torch settings) changes which
    operators a layer dispatches, and a count must not depend on the tests before it."""
    done = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), "--json"],
        cwd=Path(__file__).resolve().parent,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {name: tuple(pair) for name, pair in json.loads(done.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernels_per_block_are_the_documented_ones(variant, counted_kernels):
    documented = documented_counts()
    assert set(documented) == set(VARIANTS)
    counted = counted_kernels[variant]
    assert counted == documented[variant], (
        f"{variant}: {counted} (forward, backward) counted, {documented[variant]} in "
        f"{DOCS.name}: update its table (python tests/test_kernel_counts.py prints it)"
    )
    if variant != "standard":  # every variant costs kernels beyond standard attention's
        standard = documented["standard"]
        assert counted[0] > standard[0] and counted[1] > standard[1]


# --- the compiled coupling (printed, not tested: minutes of compiling at this shape) ----

_CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|triton_\w+|extern_kernels\.\w+)\(", re.M)


def compiled_coupling_kernels(kind: str) -> tuple[int, int]:
    """(forward, backward) kernels of ``kind``'s fused form under ``torch.compile``: the
    calls in inductor's generated ``call`` function of each graph."""
    from torch._inductor.utils import run_and_get_code

    from cqk_megatron.model.attention.fast_coupling import fused_coupling
    from cqk_megatron.variants import build_coupling

    torch._dynamo.reset()
    options = {"layers": 2} if kind == "invertible" else {"steps": 1}
    coupling = build_coupling(kind, 128, hidden=128, **options)
    q = torch.randn(SEQ, 1, 16, 128, requires_grad=True)
    k = torch.randn(SEQ, 1, 16, 128, requires_grad=True)

    def forward_and_backward():
        q_out, k_out = fused_coupling(coupling, q, k, compiled=True)
        (q_out.sum() + k_out.sum()).backward()

    _, (forward, backward) = run_and_get_code(forward_and_backward)
    bodies = (code.split("def call(", 1)[1].split("\ndef ", 1)[0] for code in (forward, backward))
    return tuple(len(_CALL.findall(body)) for body in bodies)


def main() -> None:
    init_single_process()
    if sys.argv[1:] == ["--json"]:  # the eager counts, for the test's fresh process
        print(json.dumps({variant: block_kernels(variant) for variant in VARIANTS}))
        return
    print("| variant | forward | backward |")
    for variant in VARIANTS:
        print(f"| `{variant}` | {' | '.join(map(str, block_kernels(variant)))} |")
    for kind in ("hamiltonian", "euler", "mlp_only", "invertible"):
        print(f"compiled {kind}: (forward, backward) = {compiled_coupling_kernels(kind)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
