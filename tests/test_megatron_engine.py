"""``train.engine=megatron`` (Megatron-Core's DistributedDataParallel and distributed
optimizer) on CPU with gloo: every layout gives the 1-rank loss curve, the 1-rank curve is
the DeepSpeed engine's, non-finite steps are skipped, and resume is exact.

Two spawns share the work (starting processes is the slow part on 2 cores): one rank
(initial weights, the Megatron and DeepSpeed references, the NaN run), two ranks (DP=2
with the optimizer sharded over both, TP=2, PP=2, and the DP=2 run stopped and resumed).
The ranks run the real loop, which picks the engine by ``train.engine``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from _megatron_workers import initial_weights_then_train_runs
from _multiproc import run_ranks
from _training import TINY, exits, records, synthetic_datasets, train_runs

from cqk_megatron.config import ConfigError, load_config, validate
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process
from cqk_megatron.training.engines.megatron import MegatronEngine
from cqk_megatron.training.sampler import fetch, micro_batch_indices

STEPS = 8
STOP = 4
LAYOUTS = {
    "dp2": [],
    "tp2": ["parallel.tensor_parallel=2"],
    "pp2": ["parallel.pipeline_parallel=2"],
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("megatron-runs")
    r = str(root)
    # Clipping at 0.5 is active (gradient norms are ~1), so the global norm must agree too.
    same = [
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        "train.optimizer.clip_grad=0.5",
        "train.checkpoint.hashes=false",
        "train.engine=megatron",
    ]
    layout_run = [*same, f"train.train_steps={STEPS}", f"train.init_from={r}/init"]
    nan_run = [
        *same,
        "train.train_steps=10",
        "train.optimizer.lr=1e30",
        "train.schedule.warmup_steps=0",
        "train.optimizer.clip_grad=0",
        "train.resilience.max_nan_steps=2",
    ]
    one_rank = [
        ("reference", layout_run),
        ("deepspeed", [*layout_run, "train.engine=deepspeed"]),
        ("nan", nan_run),
    ]
    run_ranks(initial_weights_then_train_runs, 1, r, [("init", [])], one_rank)
    two_ranks = [
        *[(name, [*layout_run, *extra]) for name, extra in LAYOUTS.items()],
        # the dp2 run again, stopped after step STOP and resumed: the optimizer state that
        # comes back is sharded over both ranks
        ("resumed", [*layout_run, f"train.resilience.exit_after_steps={STOP}"]),
        ("resumed", layout_run),
    ]
    run_ranks(train_runs, 2, r, two_ranks)
    return root


def _assert_same_curve(losses: list[float], expected: list[float]) -> None:
    assert len(losses) == len(expected) == STEPS
    for step, (loss, reference) in enumerate(zip(losses, expected, strict=True), 1):
        assert abs(loss - reference) <= 1e-5 * abs(reference), f"step {step}: {loss} vs {reference}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_gives_the_reference_loss_curve(runs, layout):
    reference = records(runs, "reference", "train")
    train = records(runs, layout, "train")
    _assert_same_curve([r["loss"] for r in train], [r["loss"] for r in reference])
    # the clipped global gradient norm is the same number however the model is cut
    for got, expected in zip(train, reference, strict=True):
        assert math.isclose(got["grad_norm"], expected["grad_norm"], rel_tol=1e-4)
    assert reference[-1]["loss"] < reference[0]["loss"] - 0.5  # and it trains


def test_one_rank_curve_is_the_deepspeed_engines(runs):
    # Same weights, AdamW settings, weight-decay groups, clipping and schedule: the two
    # engines are two routes to the same update.
    reference = [r["loss"] for r in records(runs, "reference", "train")]
    _assert_same_curve([r["loss"] for r in records(runs, "deepspeed", "train")], reference)


def test_non_finite_steps_are_skipped_then_abort(runs):
    (outcome,) = exits(runs, "nan")
    assert outcome.startswith("error: 2 steps in a row had non-finite gradients"), outcome
    skipped = [r for r in records(runs, "nan", "train") if r["skipped"]]
    assert len(skipped) == 2 and all(math.isnan(r["grad_norm"]) for r in skipped)


def _model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The full tensors of a ``torch_dist`` model folder, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = checkpoint.parent / (checkpoint.name + "-weights.pt")
    dcp_to_torch_save(checkpoint / "model", flat)
    return torch.load(flat, weights_only=False)


def test_resume_is_exact(runs):
    assert exits(runs, "resumed") == [str(EXIT_REQUEUE), "0"]
    straight = records(runs, "dp2", "train")
    resumed = records(runs, "resumed", "train")
    # steps 1-4, the stop, then 5-8: none repeated, none skipped, the same numbers bit for bit
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    final = f"checkpoints/iter_{STEPS:07d}"
    a = _model_weights(runs / "dp2" / final)
    b = _model_weights(runs / "resumed" / final)
    tensors = [name for name in a if isinstance(a[name], torch.Tensor)]
    assert a.keys() == b.keys() and len(tensors) >= 5  # layers are stacked per tensor kind
    for name in tensors:
        assert torch.equal(a[name], b[name]), name
    # the optimizer state is one distributed checkpoint beside the weights
    stopped = runs / "resumed" / "checkpoints" / f"iter_{STOP:07d}"
    assert (stopped / "engine" / "metadata.json").is_file()


def test_fp64_is_refused_for_the_megatron_engine():
    config = load_config(None, ["train.engine=megatron", "train.precision=fp64"])
    with pytest.raises(ConfigError, match="train.precision"):
        validate(config)


def test_bf16_steps_fp32_master_weights_with_the_weight_decay_groups():
    # In this process (a world of one): the bf16 path that GPU runs take, on CPU.
    config = load_config(None, [*TINY, "train.engine=megatron", "train.precision=bf16"])
    init_single_process(config)  # Megatron's gloo groups, which its optimizer takes
    torch.manual_seed(config.seed)
    model = build_model(config)
    engine = MegatronEngine(model, config)
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    assert matrices and all(p.dtype == torch.bfloat16 for p in matrices)
    groups = engine.optimizer.param_groups
    assert all(p.dtype == torch.float32 for g in groups for p in g["params"])  # master copies
    decayed = sum(p.numel() for g in groups if g["weight_decay"] > 0 for p in g["params"])
    assert decayed == sum(p.numel() for p in matrices)  # vectors and scalars are not decayed
    assert {g["weight_decay"] for g in groups} == {config.train.optimizer.weight_decay, 0.0}
    train, _ = synthetic_datasets(config)
    losses = []
    for step in range(6):
        indices = micro_batch_indices(step * 8, 8, 2, 0, 1)
        result = engine.train_step([fetch(train, i) for i in indices])
        assert not result.skipped and result.grad_norm > 0
        losses.append(result.loss)
    assert losses[-1] < losses[0] - 0.5, losses
