"""The training engine on CPU with gloo: layouts agree step by step, resume is exact,
checkpoints move between layouts, signals checkpoint and requeue, bad checkpoints are
refused, metrics and wandb/TensorBoard files are written, and every variant learns.

Three spawns share the work (starting processes is the slow part on 2 cores):
one rank (initial weights, DP=1 reference), two ranks (every parallel layout, resume),
one rank (checkpoint loaded under TP=1, NaN abort, logging, every variant).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _multiproc import free_port, run_ranks
from _training import exits, records, save_initial_weights, train_runs

from cqk_megatron.config import VARIANTS
from cqk_megatron.errors import EXIT_REQUEUE
from cqk_megatron.training import checkpoint
from data_tools.demo_corpus import DemoSettings, build_demo

STEPS = 10
LAYOUTS = {
    "dp2-zero1": ["train.zero_stage=1"],
    "dp2-zero2": ["train.zero_stage=2"],
    # ZeRO's overlap_comm (train.overlap_grad_reduce), as the 1B cluster config runs
    "dp2-zero1-overlap": ["train.zero_stage=1", "train.overlap_grad_reduce=true"],
    "dp2-zero3": ["train.zero_stage=3"],
    "tp2": ["parallel.tensor_parallel=2"],
    "pp2": ["parallel.pipeline_parallel=2"],
    # ZeRO's optimizer offload: on CPU the torch AdamW steps the offloaded fp32 master
    # weights, so the curve must still be the reference's (GPU uses DeepSpeedCPUAdam).
    "dp2-zero2-offload": ["train.zero_stage=2", "train.offload_optimizer=true"],
}
# Layouts of a 4-layer model, against a 4-layer reference: interleaved 1F1B needs a multiple
# of pipeline x virtual stages.
FOUR_LAYERS = ["model.num_layers=4"]
LAYOUTS_4L = {"pp2-vp2": ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"]}
# Pipeline and data parallel together (4 ranks): 1F1B then DeepSpeed's ZeRO-1 reduction.
LAYOUTS_4RANKS = {"pp2-dp2-zero1": ["parallel.pipeline_parallel=2", "train.zero_stage=1"]}
VARIANT_STEPS = 60


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    r = str(root)
    # Clipping at 0.5 is active (gradient norms are ~1), so the global norm must agree too.
    same = [
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        "train.optimizer.clip_grad=0.5",
    ]
    layout_run = [*same, f"train.train_steps={STEPS}", f"train.init_from={r}/init"]
    layout_run_4l = [
        *same,
        *FOUR_LAYERS,
        f"train.train_steps={STEPS}",
        f"train.init_from={r}/init-4l",
    ]
    resume_run = [*same, "train.train_steps=8", "train.zero_stage=2", "train.schedule.decay=wsd"]
    run_ranks(save_initial_weights, 1, r, [("init", []), ("init-4l", FOUR_LAYERS)])
    run_ranks(train_runs, 1, r, [("reference", layout_run), ("reference-4l", layout_run_4l)])
    run_ranks(
        train_runs,
        4,
        r,
        [(name, [*layout_run, *extra]) for name, extra in LAYOUTS_4RANKS.items()],
    )
    run_ranks(
        train_runs,
        2,
        r,
        [
            *[(name, [*layout_run, *extra]) for name, extra in LAYOUTS.items()],
            *[(name, [*layout_run_4l, *extra]) for name, extra in LAYOUTS_4L.items()],
            ("straight", resume_run),
            ("resumed", [*resume_run, "train.resilience.exit_after_steps=4"]),
            ("resumed", resume_run),
            ("tp2-saved", [*same, "train.train_steps=4", "parallel.tensor_parallel=2"]),
        ],
    )
    tp2_checkpoint = f"{r}/tp2-saved/checkpoints/iter_0000004"
    small = DemoSettings(max_bytes=150_000, vocab_size=700)
    demo = build_demo(root / "demo", small, progress=False)
    real_data = [
        *same,
        "train.train_steps=40",
        "model.vocab_size=768",
        f"data.prefixes=[{demo.folder}/demo_text_document]",
        f"data.tokenizer={demo.folder}/tokenizer.model",
        f"data.cache_dir={root}/index-cache",
    ]
    variant_run = [*same, f"train.train_steps={VARIANT_STEPS}", "train.optimizer.lr=1e-2"]
    # A lock file left by a rank killed while loading a JIT-built torch extension makes
    # every later load wait forever; the engine must start regardless (the CPU bridge keeps
    # DeepSpeed from loading its shared-memory op). The spawned ranks inherit the variable.
    stale = root / "torch_extensions" / "deepspeed_shm_comm" / "lock"
    stale.parent.mkdir(parents=True)
    stale.touch()
    saved = os.environ.get("TORCH_EXTENSIONS_DIR")
    os.environ["TORCH_EXTENSIONS_DIR"] = str(stale.parent.parent)
    try:
        _single_rank_runs(r, tp2_checkpoint, real_data, same, variant_run)
    finally:
        if saved is None:
            del os.environ["TORCH_EXTENSIONS_DIR"]
        else:
            os.environ["TORCH_EXTENSIONS_DIR"] = saved
    return root


def _single_rank_runs(r, tp2_checkpoint, real_data, same, variant_run) -> None:
    run_ranks(
        train_runs,
        1,
        r,
        [
            ("tp1-loaded", [*same, "train.train_steps=4"], tp2_checkpoint),
            (
                "vp-loaded",
                [*same, *FOUR_LAYERS, f"train.train_steps={STEPS}"],
                f"{r}/pp2-vp2/checkpoints/iter_{STEPS:07d}",
            ),
            ("real-data", real_data),
            (
                "nan",
                [
                    *same,
                    "train.train_steps=20",
                    "train.optimizer.lr=1e30",
                    "train.schedule.warmup_steps=0",
                    "train.optimizer.clip_grad=0",
                    "train.resilience.max_nan_steps=3",
                ],
            ),
            (
                "logged",
                [
                    *same,
                    "train.train_steps=3",
                    "log.wandb_mode=offline",
                    "log.tensorboard=true",
                    "train.eval_interval=2",
                ],
            ),
            *[
                (
                    f"variant-{v}",
                    [*variant_run, f"attention.coupling={c}", f"attention.scoring={s}"],
                )
                for v, (c, s) in VARIANTS.items()
            ],
        ],
    )


@pytest.mark.parametrize("layout", [*LAYOUTS, *LAYOUTS_4L, *LAYOUTS_4RANKS])
def test_layout_gives_the_reference_loss_curve(runs, layout):
    reference_name = "reference-4l" if layout in LAYOUTS_4L else "reference"
    reference = [r["loss"] for r in records(runs, reference_name, "train")]
    losses = [r["loss"] for r in records(runs, layout, "train")]
    assert len(losses) == len(reference) == STEPS
    for step, (loss, expected) in enumerate(zip(losses, reference, strict=True), 1):
        assert abs(loss - expected) <= 1e-5 * abs(expected), f"step {step}: {loss} vs {expected}"
    assert reference[-1] < reference[0] - 0.5  # and it trains
    (summary,) = records(runs, layout, "summary")
    assert (
        summary["first_batch_sha256"]
        == records(runs, "reference", "summary")[0]["first_batch_sha256"]
    )


def _module_state(run_dir: Path, step: int) -> dict:
    path = run_dir / "checkpoints" / f"iter_{step:07d}" / "engine" / "pp0" / "ds"
    return torch.load(path / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def test_engine_starts_despite_a_stale_torch_extension_lock(runs):
    # The single-rank runs started under a TORCH_EXTENSIONS_DIR holding a stale lock.
    assert (runs / "torch_extensions" / "deepspeed_shm_comm" / "lock").exists()
    assert exits(runs, "tp1-loaded") == ["0"] and exits(runs, "logged") == ["0"]


def test_resume_is_exact(runs):
    assert exits(runs, "resumed") == [str(EXIT_REQUEUE), "0"]
    straight = records(runs, "straight", "train")
    resumed = records(runs, "resumed", "train")
    # steps 1-4, the stop, then 5-8: none repeated, none skipped, the same losses bit for bit
    assert [r["step"] for r in resumed] == list(range(1, 9))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]
    assert [r["lr"] for r in resumed] == [r["lr"] for r in straight]
    a, b = _module_state(runs / "straight", 8), _module_state(runs / "resumed", 8)
    assert a.keys() == b.keys()
    tensors = [name for name in a if isinstance(a[name], torch.Tensor)]
    assert len(tensors) > 10
    for name in tensors:
        assert torch.equal(a[name], b[name]), name
    state, _ = checkpoint.load_trainer_state(runs / "resumed" / "checkpoints" / "iter_0000008")
    assert state.consumed_samples == 8 * 8 and state.step == 8


def test_tp2_checkpoint_loads_under_tp1_with_the_same_validation_loss(runs):
    (saved,) = records(runs, "tp2-saved", "valid")
    (loaded,) = records(runs, "tp1-loaded", "valid")
    assert saved["step"] == loaded["step"] == 4
    assert abs(saved["val_loss"] - loaded["val_loss"]) <= 1e-5 * saved["val_loss"]
    assert records(runs, "tp1-loaded", "train") == []  # nothing left to train


def test_interleaved_pipeline_checkpoint_loads_on_one_rank_with_the_same_validation_loss(runs):
    (saved,) = records(runs, "pp2-vp2", "valid")
    (loaded,) = records(runs, "vp-loaded", "valid")
    assert saved["step"] == loaded["step"] == STEPS
    assert abs(saved["val_loss"] - loaded["val_loss"]) <= 1e-5 * saved["val_loss"]


def test_non_finite_steps_are_skipped_then_abort(runs):
    (outcome,) = exits(runs, "nan")
    assert outcome.startswith("error: 3 steps in a row had non-finite gradients"), outcome
    skipped = [r for r in records(runs, "nan", "train") if r["skipped"]]
    assert len(skipped) == 3


def test_metrics_wandb_and_tensorboard_are_written(runs):
    train = records(runs, "logged", "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    keys = ("tokens", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "mem_gb", "tflops")
    for key in keys:
        assert all(key in r for r in train), key
    valid = records(runs, "logged", "valid")
    assert [v["step"] for v in valid] == [2, 3] and valid[-1]["final"]
    (summary,) = records(runs, "logged", "summary")
    assert summary["params_total"] > summary["params_non_embedding"] > 0
    assert summary["flops_per_token"] > 6 * summary["params_non_embedding"]
    assert all(r["tflops"] > 0 and r["mfu"] is None for r in train)  # no GPU peak on CPU
    offline = list((runs / "logged" / "wandb").glob("offline-run-*"))
    assert len(offline) == 1 and list(offline[0].glob("run-*.wandb"))
    assert list((runs / "logged" / "tensorboard").glob("events.out.tfevents.*"))


def test_the_first_batch_fingerprint_tells_datasets_apart(runs):
    (synthetic,) = records(runs, "reference", "summary")
    (real,) = records(runs, "real-data", "summary")
    assert len(real["first_batch_sha256"]) == 64
    assert real["first_batch_sha256"] != synthetic["first_batch_sha256"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_variant_learns(runs, variant):
    losses = [r["loss"] for r in records(runs, f"variant-{variant}", "train")]
    assert len(losses) == VARIANT_STEPS
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.6 * first, (first, last)


def test_trains_on_a_dataset_made_by_the_data_tools(runs):
    train = records(runs, "real-data", "train")
    assert len(train) == 40
    first, last = sum(r["loss"] for r in train[:5]) / 5, sum(r["loss"] for r in train[-5:]) / 5
    assert last < first - 1.0, (first, last)
    (final,) = [v for v in records(runs, "real-data", "valid") if v.get("final")]
    assert final["val_loss"] < train[0]["loss"]


def test_corrupted_checkpoint_is_refused_and_the_previous_one_used(runs):
    checkpoints = runs / "resumed" / "checkpoints"
    newest = checkpoints / "iter_0000008"
    victim = next((newest / "model").glob("*.distcp"))
    victim.write_bytes(victim.read_bytes()[:-10])  # truncated
    folder, refused = checkpoint.find_resumable(checkpoints)
    assert folder == checkpoints / "iter_0000004"
    assert "truncated" in refused[0] and victim.name in refused[0]
    with pytest.raises(checkpoint.CheckpointError, match="manifest"):
        checkpoint.verify(newest)
    half_written = checkpoints / "iter_0000009"
    half_written.mkdir()
    folder, refused = checkpoint.find_resumable(checkpoints)
    assert folder == checkpoints / "iter_0000004"
    assert "never completed" in refused[0]


def test_sigterm_checkpoints_and_requeues_then_resumes(tmp_path):
    # SIGTERM goes to the whole process group, as Slurm signals every process of a step,
    # after a first save has started Megatron's checkpoint-writer helper process: the save
    # the signal asks for must still succeed (the helper must not die of the signal).
    script = Path(__file__).with_name("_train_script.py")
    # the checkout's package, as the other tests' processes get it (not an installed one)
    env = {
        **os.environ,
        "MASTER_PORT": str(free_port()),
        "DS_ACCELERATOR": "cpu",
        "PYTHONPATH": str(Path(__file__).resolve().parent.parent),
    }
    args = [
        sys.executable,
        str(script),
        str(tmp_path),
        "sig",
        "train.train_steps=400",
        "train.eval_interval=1000",
        "train.checkpoint.save_interval=2",
        "train.checkpoint.keep_last=1",
        "train.checkpoint.hashes=false",
    ]
    process = subprocess.Popen(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    metrics = tmp_path / "sig" / "metrics.jsonl"
    first_save = tmp_path / "sig" / "checkpoints" / "latest"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and process.poll() is None:
        if first_save.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    output = process.communicate(timeout=240)[0].decode()
    assert process.returncode == EXIT_REQUEUE, output[-2000:]
    folder, refused = checkpoint.find_resumable(tmp_path / "sig" / "checkpoints")
    assert folder is not None and refused == []
    stopped_at = checkpoint.verify(folder)
    assert 3 <= stopped_at < 400
    assert "SIGTERM" in output
    finish = subprocess.run(
        [*args[:4], "train.train_steps=" + str(stopped_at + 2), *args[5:]],
        env={**env, "MASTER_PORT": str(free_port())},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert finish.returncode == 0, finish.stdout[-2000:] + finish.stderr[-2000:]
    assert f"at step {stopped_at}" in finish.stdout
    steps = [
        json.loads(line)["step"] for line in metrics.read_text().splitlines() if '"train"' in line
    ]
    assert steps[-2:] == [stopped_at + 1, stopped_at + 2]
