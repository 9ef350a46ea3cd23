"""The layouts a cluster config or the planner can produce that the other multi-rank tests do
not take, on four ranks, in bf16 (real DeepSpeed and Megatron-Core, gloo):

- pipeline x data parallel with interleaved 1F1B (PP=2 x 2 virtual stages x DP=2), under
  both engines, which must agree with each other and with one rank over 10 steps; resumed
  in mid-run, exactly;
- the Megatron engine's gradient reduction overlapped with the backward
  (``train.overlap_grad_reduce``, what ``cqk plan --zero distopt`` gives) at TP=2+SP x DP=2;
  resumed in mid-run, exactly;
- ZeRO-3 at TP=2+SP x DP=2, with every vocabulary shard above DeepSpeed's persistence
  threshold, saved and resumed in mid-run, exactly;
- TP=4 + SP under ZeRO-2 without overlap_comm; TP=2+SP x DP=2 under ZeRO-2 with the
  optimizer offloaded; TP=2 x PP=2, and with SP and 2 virtual stages; PP=4 under the
  Megatron engine. (Offload with tied
  embeddings under PP crashed at step 1, DeepSpeed having reduced the embedding's gradient
  in its hooks: ``validate()`` now refuses it, tests/test_config.py.)

Every run is the GPT-2 family (biases under sequence parallelism) with tied embeddings (two
copies under pipeline parallelism), starts from the same TP=1 weights, runs the replica
check at every step (a copy that drifts stops the run, naming it), and is held to the
one-rank run of its engine with the bf16 tolerances of ``_curves.py``.

Two spawns: one rank (initial weights, the references), four ranks (the layouts, in turn).
PP=4 comes after the PP=2 layouts on purpose: Megatron's ``destroy_model_parallel`` kept
the embedding group's ranks, so its middle stages asked for a group they did not have
(``process_groups.init_model_parallel`` now forgets them).
"""

from __future__ import annotations

import pytest
from _curves import STEPS, agree, curve
from _megatron_workers import initial_weights_then_train_runs
from _multiproc import run_ranks
from _training import exits, records, train_runs

from cqk_megatron.config import family_overrides

MEGATRON = ["train.engine=megatron"]
TP2SP = ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"]
INTERLEAVED = ["parallel.pipeline_parallel=2", "parallel.virtual_pipeline=2"]
# 4 layers: one per stage at PP=4, one per virtual stage at PP=2 x 2
MODEL = [*family_overrides("gpt2"), "model.tie_embeddings=true", "model.num_layers=4"]
# ZeRO-3's model, against its own one-rank run: vocabulary 4096 x hidden 64, so each TP=2
# shard of the tied embedding holds 131,072 elements, above ZeRO-3's default persistence
# threshold (1e5): ZeRO-3 really partitions and empties it. (Ten steps teach this
# vocabulary nothing measurable, so the small one serves the rest.)
WIDE = ["model.vocab_size=4096"]
WIDE_LAYOUTS = ("ds-z3-tp2sp-dp2",)
# 8 sequences a step, one a micro-batch: 4 micro-batches a rank at DP=2, 8 at DP=1
BF16 = ["train.precision=bf16", "train.micro_batch_size=1", "train.global_batch_size=8"]
# the resumed runs start from the straight run's checkpoint of this step, its only one
# before the last (train.checkpoint.keep_last keeps both)
STOP = 5
LAYOUTS = {
    "ds-pp2-vp2-dp2": [*INTERLEAVED, f"train.checkpoint.save_interval={STOP}"],
    "mg-pp2-vp2-dp2": [*MEGATRON, *INTERLEAVED],
    "mg-tp2sp-dp2-overlap": [
        *MEGATRON,
        *TP2SP,
        "train.overlap_grad_reduce=true",
        f"train.checkpoint.save_interval={STOP}",
    ],
    "ds-z3-tp2sp-dp2": ["train.zero_stage=3", *TP2SP, f"train.checkpoint.save_interval={STOP}"],
    "ds-z2-tp4sp": ["train.zero_stage=2", "parallel.tensor_parallel=4", TP2SP[1]],
    "ds-z2-tp2sp-dp2-offload": ["train.zero_stage=2", *TP2SP, "train.offload_optimizer=true"],
    "ds-tp2pp2": ["parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"],
    "ds-tp2sp-pp2-vp2": [*TP2SP, *INTERLEAVED],
    "mg-pp4": [*MEGATRON, "parallel.pipeline_parallel=4"],
}
RESUMED = ("ds-pp2-vp2-dp2", "mg-tp2sp-dp2-overlap", "ds-z3-tp2sp-dp2")
CLIP = 0.3  # below every step's gradient norm here (checked): clipping binds throughout
# Bounds that end a hung collective or save in about a minute instead of the defaults' ten.
SHORT_TIMEOUTS = [
    "train.resilience.save_timeout_s=60",
    "train.resilience.step_timeout_s=60",
    "train.resilience.collective_timeout_s=90",
]
SPAWN_TIMEOUT_S = 900


def _reference(layout: str) -> str:
    """The one-rank run of ``layout``'s engine and model."""
    engine = layout.split("-", 1)[0]
    return f"ref-{engine}-wide" if layout in WIDE_LAYOUTS else f"ref-{engine}"


def _model(root: str, wide: bool) -> list[str]:
    """The model's overrides and its initial weights: the wide vocabulary's, or the small's."""
    if wide:
        return [*WIDE, f"train.init_from={root}/init-wide"]
    return [f"train.init_from={root}/init"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cluster-matrix")
    r = str(root)
    same = [
        *MODEL,
        *BF16,
        *SHORT_TIMEOUTS,
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        f"train.optimizer.clip_grad={CLIP}",
        "train.checkpoint.hashes=false",
        f"train.train_steps={STEPS}",
    ]
    inits = [("init", [*MODEL, *BF16]), ("init-wide", [*MODEL, *BF16, *WIDE])]
    references = [
        ("ref-ds", [*same, *_model(r, wide=False)]),
        ("ref-mg", [*same, *_model(r, wide=False), *MEGATRON]),
        ("ref-ds-wide", [*same, *_model(r, wide=True)]),
    ]
    run_ranks(initial_weights_then_train_runs, 1, r, inits, references, timeout_s=SPAWN_TIMEOUT_S)
    run_of = {name: [*same, *_model(r, name in WIDE_LAYOUTS), *LAYOUTS[name]] for name in LAYOUTS}
    checkpoint = f"checkpoints/iter_{STOP:07d}"
    resumed = [(f"{name}-resumed", run_of[name], f"{r}/{name}/{checkpoint}") for name in RESUMED]
    run_ranks(train_runs, 4, r, [*run_of.items(), *resumed], timeout_s=SPAWN_TIMEOUT_S)
    return root


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_gives_the_one_rank_run(runs, layout):
    agree(runs, layout, _reference(layout), "bf16")


def test_both_engines_agree_on_interleaved_pipeline_and_data_parallel(runs):
    agree(runs, "ds-pp2-vp2-dp2", "mg-pp2-vp2-dp2", "bf16")


@pytest.mark.parametrize("layout", RESUMED)
def test_a_run_resumed_in_mid_run_continues_the_straight_run_exactly(runs, layout):
    assert exits(runs, f"{layout}-resumed") == ["0"]
    resumed = records(runs, f"{layout}-resumed", "train")
    straight = records(runs, layout, "train")[STOP:]
    assert [r["step"] for r in resumed] == list(range(STOP + 1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr"):
        assert [r[key] for r in resumed] == [r[key] for r in straight], key


@pytest.mark.parametrize("name", ["ref-ds", "ref-mg"])
def test_clipping_binds_and_the_references_train(runs, name):
    points = curve(runs, name)
    assert all(norm > CLIP for _, norm in points), points
    assert points[-1][0] < points[0][0] - 0.5, points
