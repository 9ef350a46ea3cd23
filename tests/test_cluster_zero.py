"""DeepSpeed ZeRO in the settings a cluster run takes, on CPU with gloo (real DeepSpeed):

- bf16: gradients are summed in fp32 over micro-batches and data-parallel ranks, so DP=2
  (8 micro-batches a rank) gives the DP=1 run under ZeRO-1 and, to fp32 rounding, ZeRO-2;
  PP=2 (Megatron's schedule calls plain backward) does too, with and without optimizer
  offload; the DeepSpeed and Megatron engines agree on the same layout over 10 steps; a
  bf16 ZeRO-1 run stopped and resumed is exact;
- ZeRO-3 with parameters above ``stage3_param_persistence_threshold`` (which DeepSpeed
  empties between forwards): weights loaded before the engine reach its shards, saves in
  mid-run hold whole tensors, and the run resumed from one equals the straight run in
  every loss and every weight; the conversion seam reads such a checkpoint whole;
- DeepSpeed binds this rank's device (``device()``), not ``cuda:LOCAL_RANK``.

Three spawns: one rank (initial weights, the DP=1 reference), two ranks (the bf16
layouts), two ranks (ZeRO-3; its own spawn, so that a hang there leaves the rest judged).

bf16 tolerances. From the same weights and batch (step 1), two runs whose gradients are
summed in fp32 differ only by the order of those sums: measured <= 1.2e-7 relative in
the gradient norm (bf16 sums were 7e-6 to 1e-4 off), so step 1 is held to 1e-6. After an
update, an fp32-rounding difference in the master weights flips the rounding of some
bf16 parameters, and those flips compound: two DeepSpeed layouts that differ only in the
order of their fp32 sums (ZeRO-2 and PP=2 against DP=1) drift apart by up to 3.8e-5 in
loss and 3.3e-4 in gradient norm over 10 steps. ``BF16_DRIFT`` allows five times that.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _megatron_workers import initial_weights_then_train_runs
from _multiproc import run_ranks
from _training import TINY, exits, records, train_runs

from cqk_megatron.config import load_config
from cqk_megatron.errors import EXIT_REQUEUE

LINEAR = torch.nn.functional.linear  # torch's own, before any engine ran in this process

STEPS = 10
# 16 sequences a step, one a micro-batch: 8 micro-batches on each of 2 data-parallel ranks
# (16 on one), the sums that bf16 accumulation rounds.
BF16 = [
    "train.precision=bf16",
    "train.micro_batch_size=1",
    "train.global_batch_size=16",
]
ZERO2 = ["train.zero_stage=2"]
PP2 = ["parallel.pipeline_parallel=2"]
OFFLOAD = ["train.offload_optimizer=true"]
MEGATRON = ["train.engine=megatron"]
FP32_ROUNDING = 1e-6  # relative, step 1 (see the module's docstring)
BF16_DRIFT = (2e-4, 2e-3)  # relative loss, gradient norm over STEPS (ditto)
STOP = 5  # the bf16 ZeRO-1 resume stops here

# ZeRO-3: the embedding and the output layer have 2048 x 64 = 131,072 elements each, above
# DeepSpeed's default persistence threshold (1e5), so ZeRO-3 really partitions them.
WIDE_VOCAB = ["model.vocab_size=2048"]
ZERO3 = ["train.zero_stage=3", "train.checkpoint.save_interval=3"]
Z3_STEPS, Z3_STOP = 6, 3
# Bounds that end a hung save in about a minute (each rank's watchdog exits 76) instead of
# the defaults' ten.
SHORT_TIMEOUTS = [
    "train.resilience.save_timeout_s=45",
    "train.resilience.step_timeout_s=45",
    "train.resilience.collective_timeout_s=60",
]
SPAWN_TIMEOUT_S = 420


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("cluster-zero")
    r = str(root)
    # Clipping at 0.5 is active (gradient norms are ~1), so the global norm must agree too.
    same = [
        *BF16,
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        "train.optimizer.clip_grad=0.5",
        "train.checkpoint.hashes=false",
        f"train.train_steps={STEPS}",
        f"train.init_from={r}/init",
    ]
    inits = [("init", BF16), ("init-wide", [*BF16, *WIDE_VOCAB])]
    run_ranks(
        initial_weights_then_train_runs, 1, r, inits, [("dp1", same)], timeout_s=SPAWN_TIMEOUT_S
    )
    run_ranks(
        train_runs,
        2,
        r,
        [
            ("z1-dp2", same),
            ("z2-dp2", [*same, *ZERO2]),
            ("pp2", [*same, *PP2]),
            ("pp2-offload", [*same, *PP2, *OFFLOAD]),
            ("mg-dp2", [*same, *MEGATRON]),
            ("z1-resumed", [*same, f"train.resilience.exit_after_steps={STOP}"]),
            ("z1-resumed", same),
        ],
        timeout_s=SPAWN_TIMEOUT_S,
    )
    wide = [
        *BF16,
        *WIDE_VOCAB,
        *SHORT_TIMEOUTS,
        "train.eval_interval=100",
        "train.checkpoint.hashes=false",
        f"train.train_steps={Z3_STEPS}",
        f"train.init_from={r}/init-wide",
    ]
    zero3_failure = None
    try:
        run_ranks(
            train_runs,
            2,
            r,
            [
                ("z1-wide", [*wide, "train.train_steps=1", "train.checkpoint.save_interval=100"]),
                ("z3-straight", [*wide, *ZERO3]),
                ("z3-resumed", [*wide, *ZERO3, f"train.resilience.exit_after_steps={Z3_STOP}"]),
                ("z3-resumed", [*wide, *ZERO3]),
            ],
            timeout_s=SPAWN_TIMEOUT_S,
        )
    except Exception as error:  # judged by the ZeRO-3 tests only
        zero3_failure = f"{type(error).__name__}: {error}"
    return {"root": root, "zero3_failure": zero3_failure}


def _curve(root: Path, name: str) -> list[tuple[float, float]]:
    assert exits(root, name)[-1] == "0", (name, exits(root, name))
    return [(r["loss"], r["grad_norm"]) for r in records(root, name, "train")]


def _relative(got: list[float], expected: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, expected, strict=True))


def _differences(root: Path, name: str, reference: str) -> dict[str, float]:
    """Relative differences of the losses and gradient norms: at step 1, and the largest."""
    got, expected = _curve(root, name), _curve(root, reference)
    assert len(got) == len(expected) == STEPS
    return {
        "loss_1": _relative([got[0][0]], [expected[0][0]]),
        "norm_1": _relative([got[0][1]], [expected[0][1]]),
        "loss": _relative([g[0] for g in got], [e[0] for e in expected]),
        "norm": _relative([g[1] for g in got], [e[1] for e in expected]),
    }


def _within_bf16_drift(diff: dict[str, float]) -> bool:
    return (
        diff["loss_1"] == 0
        and diff["norm_1"] <= FP32_ROUNDING
        and diff["loss"] <= BF16_DRIFT[0]
        and diff["norm"] <= BF16_DRIFT[1]
    )


def _model_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The whole tensors of a ``torch_dist`` model folder, read without a process group."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    flat = checkpoint.parent / (checkpoint.name + "-weights.pt")
    if not flat.exists():
        dcp_to_torch_save(checkpoint / "model", flat)
    state = torch.load(flat, weights_only=False)
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}


# -- bf16: fp32 gradient sums ----------------------------------------------------------


def test_bf16_zero1_data_parallel_equals_the_one_rank_run(runs):
    # before (bf16 accumulation and all-reduce): 3.5e-5 off in loss, 5.5e-4 in gradient
    # norm over 10 steps, 7.0e-6 in the norm at step 1
    assert _curve(runs["root"], "z1-dp2") == _curve(runs["root"], "dp1")


@pytest.mark.parametrize("run", ["z2-dp2", "pp2", "pp2-offload"])
def test_bf16_layouts_give_the_one_rank_run_to_fp32_rounding(runs, run):
    # measured: z2-dp2 step 1 norm 1.2e-7, then 2.8e-5 / 3.3e-4 (before: 9.8e-5 at step 1);
    # pp2 0, then 3.8e-5 / 1.8e-4 (before: "stack expects a non-empty TensorList" once the
    # fp32 sums were asked for without BF16_Optimizer's hooks)
    diff = _differences(runs["root"], run, "dp1")
    assert _within_bf16_drift(diff), diff
    curve = _curve(runs["root"], run)
    assert curve[-1][0] < curve[0][0] - 0.5  # and it trains
    assert all(math.isfinite(n) and n > 0 for _, n in curve)


def test_the_deepspeed_and_megatron_engines_agree_in_bf16(runs):
    # the same DP=2 layout and initial weights; both sum gradients in fp32 and step fp32
    # master weights with torch's AdamW. measured: step 1 norm 4.5e-8, then 4.5e-5 in loss
    # and 1.9e-4 in gradient norm over 10 steps (before: 3.3e-5 at step 1, then 8.4e-5 and
    # 3.5e-4)
    diff = _differences(runs["root"], "z1-dp2", "mg-dp2")
    assert _within_bf16_drift(diff), diff


def test_bf16_zero1_resume_is_exact(runs):
    root = runs["root"]
    assert exits(root, "z1-resumed") == [str(EXIT_REQUEUE), "0"]
    resumed, straight = records(root, "z1-resumed", "train"), records(root, "z1-dp2", "train")
    assert [r["step"] for r in resumed] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key


@pytest.mark.parametrize(
    ("stage", "optimizer"),
    [(1, "BF16_Optimizer"), (2, "DeepSpeedZeroOptimizer"), (3, "DeepSpeedZeroOptimizer_Stage3")],
)
def test_bf16_deepspeed_accumulates_and_reduces_in_fp32(stage, optimizer, monkeypatch):
    # In this process (a world of one), the real engine: which optimizer DeepSpeed chose.
    # Before: DeepSpeedZeroOptimizer at stage 1 too, accumulating and reducing in bf16.
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed requires it (torchrun, srun set it)
    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.process_groups import init_single_process
    from cqk_megatron.training.engines.deepspeed import DeepSpeedEngine

    init_single_process()
    config = load_config(None, [*TINY, "train.precision=bf16", f"train.zero_stage={stage}"])
    torch.manual_seed(config.seed)
    engine = DeepSpeedEngine(build_model(config), config)
    wrapped = engine.optimizer
    assert type(wrapped).__name__ == optimizer
    assert engine.engine.communication_data_type == torch.float32
    accumulation = wrapped.grad_acc_dtype if stage == 1 else wrapped.gradient_accumulation_dtype
    assert accumulation == torch.float32
    # ZeRO-3 leaves torch's F.linear to the rest of the process (the coupling's fused form
    # and forward-mode AD use it); DeepSpeed's default replaced it for good.
    assert torch.nn.functional.linear is LINEAR, torch.nn.functional.linear


# -- ZeRO-3: loads and mid-run saves ---------------------------------------------------


def test_zero3_saves_in_mid_run_and_resumes_exactly(runs):
    # before: rank 1's watchdog exited 76 in the first save (rank 0 had raised
    # ZeroDivisionError in Megatron's dist_checkpointing/mapping.py on an emptied parameter)
    assert runs["zero3_failure"] is None, runs["zero3_failure"]
    root = runs["root"]
    assert exits(root, "z3-straight") == ["0"]
    assert exits(root, "z3-resumed") == [str(EXIT_REQUEUE), "0"]
    straight, resumed = records(root, "z3-straight", "train"), records(root, "z3-resumed", "train")
    assert [r["step"] for r in resumed] == list(range(1, Z3_STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key
    for step in (Z3_STOP, Z3_STEPS):
        folder = f"checkpoints/iter_{step:07d}"
        a = _model_weights(root / "z3-straight" / folder)
        b = _model_weights(root / "z3-resumed" / folder)
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), (step, name)
        # whole tensors, not ZeRO-3's empty placeholders
        for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert a[name].shape == (2048, 64) and a[name].abs().max() > 0, name


def test_zero3_trains_from_the_weights_loaded_before_it_partitions_them(runs):
    # train.init_from is loaded into the whole model before DeepSpeed partitions it: the
    # first step's loss (a forward of the initial weights) is ZeRO-1's, bit for bit, and
    # so, to the rounding of the norm's own fp32 sums, is its gradient norm (measured
    # 4.7e-6 relative; ZeRO-3 sums the squares of each 131k-element partition apart)
    assert runs["zero3_failure"] is None, runs["zero3_failure"]
    root = runs["root"]
    (zero1,) = records(root, "z1-wide", "train")
    zero3 = records(root, "z3-straight", "train")[0]
    assert zero3["loss"] == zero1["loss"]
    assert abs(zero3["grad_norm"] - zero1["grad_norm"]) <= 1e-5 * zero1["grad_norm"]


def test_a_zero3_mid_run_checkpoint_converts_whole(runs):
    # the conversion seam (cqk-export reads through it) loads a TP=1 model in this process
    assert runs["zero3_failure"] is None, runs["zero3_failure"]
    from cqk_megatron.convert.checkpoint_io import read_full_state_dict

    folder = runs["root"] / "z3-straight" / f"checkpoints/iter_{Z3_STOP:07d}"
    config = load_config(folder / "config.yaml")
    state = read_full_state_dict(folder, config)
    saved = _model_weights(folder)
    assert torch.equal(
        state["embedding.word_embeddings.weight"], saved["embedding.word_embeddings.weight"]
    )
    assert torch.equal(state["output_layer.weight"], saved["output_layer.weight"])


# -- DeepSpeed's device ----------------------------------------------------------------


def test_deepspeed_binds_the_ranks_device_not_local_rank(monkeypatch):
    # A task that sees one GPU (CUDA_VISIBLE_DEVICES) as local rank 5 runs on cuda:0. No
    # GPU here: CUDA's presence is faked, and DeepSpeed's own device binding runs on a
    # stand-in for its engine with the accelerator's set_device recorded.
    import deepspeed.runtime.engine as ds_engine
    from deepspeed.accelerator import get_accelerator

    from cqk_megatron.training.engines.deepspeed import device_args

    monkeypatch.setenv("LOCAL_RANK", "5")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = device_args()
    assert args.device_rank == 0
    bound: list[int] = []
    monkeypatch.setattr(get_accelerator(), "set_device", bound.append)
    monkeypatch.setattr(ds_engine.dist, "get_world_size", lambda *a, **k: 1)
    monkeypatch.setattr(ds_engine.dist, "get_rank", lambda *a, **k: 0)
    stand_in = SimpleNamespace(local_rank=5)
    ds_engine.DeepSpeedEngine._set_distributed_vars(stand_in, args)
    assert bound == [0]
    ds_engine.DeepSpeedEngine._set_distributed_vars(stand_in, None)  # what it did before
    assert bound == [0, 5]
