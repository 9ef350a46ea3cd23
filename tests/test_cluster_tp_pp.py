"""What DeepSpeed's engine must do in place of Megatron's ``finalize_model_grads``, checked
in real runs of the training loop (gloo), GPT-2 family with tied embeddings, fp32 and bf16:

- sequence parallelism: Megatron marks the row-parallel biases (``linear_proj.bias``,
  ``linear_fc2.bias``) ``sequence_parallel`` and leaves the sum of their partial gradients
  across TP ranks to ``finalize_model_grads``, which only the Megatron engine calls;
- tied embeddings under pipeline parallelism: the first stage's embedding and the last
  stage's output layer are two copies of one weight, whose gradients must be summed over
  Megatron's embedding group, and counted once in the gradient norm.

Each layout starts from the same TP=1 weights and is compared, over ``STEPS`` steps with
gradient clipping active, with the one-rank run of the same engine and with the other
engine on the same layout (and with interleaved 1F1B, PP=2 x 2 virtual stages, fp32);
the copies that must stay identical are compared bitwise.

Two spawns: one rank (initial weights, the references), two ranks (the layouts).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _cluster_tp_pp_workers import (
    dump_path,
    tp_sums_path,
    train_and_count_tp_sums,
    train_and_dump,
)
from _curves import STEPS, agree, curve, worst
from _multiproc import run_ranks
from _training import TINY, exits

from cqk_megatron.compat import cpu_bridge
from cqk_megatron.config import family_overrides, load_config

PRECISIONS = ("fp32", "bf16")
ENGINES = ("ds", "mg")
ENGINE_OVERRIDES = {"ds": [], "mg": ["train.engine=megatron"]}
GPT2_TIED = [*family_overrides("gpt2"), "model.tie_embeddings=true"]
LAYOUTS = {
    "tp2sp": ["parallel.tensor_parallel=2", "parallel.sequence_parallel=true"],
    "pp2": ["parallel.pipeline_parallel=2"],
}
# DeepSpeed ZeRO-2 at TP=2 (the 1B run's layout before it moved to the distributed
# optimizer): its gradient reduction overlapped with the backward (overlap_comm), then the TP
# sums on the partition
ZERO2_OVERLAP = ["train.zero_stage=2", "train.overlap_grad_reduce=true"]
CLIP = 0.3  # below every step's gradient norm here (checked): clipping binds throughout
# Tolerances: tests/_curves.py.


# Interleaved 1F1B (2 virtual stages per rank): the tied copies are in the first rank's
# first chunk and the last rank's last chunk; four layers, one per chunk, fp32.
FOUR_LAYERS = ["model.num_layers=4"]
INTERLEAVED = [*LAYOUTS["pp2"], "parallel.virtual_pipeline=2"]


def _common(root: str, precision: str, init: str = "init") -> list[str]:
    return [
        *GPT2_TIED,
        f"train.precision={precision}",
        "train.eval_interval=100",
        "train.checkpoint.save_interval=100",
        f"train.optimizer.clip_grad={CLIP}",
        "train.checkpoint.hashes=false",
        f"train.train_steps={STEPS}",
        f"train.init_from={root}/{init}-{precision}",
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cluster-tp-pp")
    r = str(root)
    inits = [(f"init-{p}", [*GPT2_TIED, f"train.precision={p}"]) for p in PRECISIONS]
    one_rank = [
        (f"ref-{engine}-{p}", [*_common(r, p), *ENGINE_OVERRIDES[engine]])
        for p in PRECISIONS
        for engine in ENGINES
    ]
    four = [*_common(r, "fp32", init="init4"), *FOUR_LAYERS]
    inits.append(("init4-fp32", [*GPT2_TIED, *FOUR_LAYERS]))
    one_rank.append(("ref4-ds-fp32", four))
    run_ranks(train_and_dump, 1, r, inits, one_rank)
    two_ranks = [
        (f"{engine}-{layout}-{p}", [*_common(r, p), *ENGINE_OVERRIDES[engine], *overrides])
        for p in PRECISIONS
        for layout, overrides in LAYOUTS.items()
        for engine in ENGINES
    ]
    # and once from the seed, no init_from: Megatron's build must sync the two copies
    seeded = [o for o in _common(r, "fp32") if not o.startswith("train.init_from")]
    two_ranks.append(("ds-pp2-seeded", [*seeded, *LAYOUTS["pp2"]]))
    for engine in ENGINES:
        two_ranks.append(
            (f"{engine}-interleaved-fp32", [*four, *ENGINE_OVERRIDES[engine], *INTERLEAVED])
        )
    for p in PRECISIONS:
        zero2 = [*_common(r, p), *LAYOUTS["tp2sp"], *ZERO2_OVERLAP]
        two_ranks.append((f"ds-tp2sp-zero2-{p}", zero2))
    run_ranks(train_and_dump, 2, r, [], two_ranks)
    return root


def _dump(runs: Path, name: str, rank: int) -> dict:
    return torch.load(dump_path(runs, name, rank))


CASES = [(e, layout, p) for p in PRECISIONS for layout in LAYOUTS for e in ENGINES]
IDS = [f"{e}-{layout}-{p}" for e, layout, p in CASES]


@pytest.mark.parametrize(("engine", "layout", "precision"), CASES, ids=IDS)
def test_layout_gives_the_one_rank_run(runs, engine, layout, precision):
    agree(runs, f"{engine}-{layout}-{precision}", f"ref-{engine}-{precision}", precision)


@pytest.mark.parametrize(("layout", "precision"), [(la, p) for p in PRECISIONS for la in LAYOUTS])
def test_both_engines_agree_on_the_layout(runs, layout, precision):
    agree(runs, f"ds-{layout}-{precision}", f"mg-{layout}-{precision}", precision)


@pytest.mark.parametrize(("engine", "precision"), [(e, p) for p in PRECISIONS for e in ENGINES])
def test_replicated_parameters_stay_identical_across_tp_ranks(runs, engine, precision):
    name = f"{engine}-tp2sp-{precision}"
    ranks = [_dump(runs, name, rank) for rank in (0, 1)]
    replicated = [n for n in ranks[0]["final"] if n not in ranks[0]["sharded"]]
    biases = [n for n in replicated if n.endswith(("linear_proj.bias", "linear_fc2.bias"))]
    assert len(biases) == 4, replicated  # two layers, both row-parallel biases
    differ = {
        n: (ranks[0]["final"][n] - ranks[1]["final"][n]).abs().max().item()
        for n in replicated
        if not torch.equal(ranks[0]["final"][n], ranks[1]["final"][n])
    }
    assert differ == {}


TIED = ("embedding.word_embeddings.weight", "output_layer.weight")


def _tied_copies(runs: Path, name: str, when: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The first stage's embedding and the last stage's output layer (under interleaving,
    in the first rank's first chunk ``0.`` and the last rank's last chunk ``1.``)."""
    first, last = _dump(runs, name, 0)[when], _dump(runs, name, 1)[when]
    assert not any(n.endswith(TIED[1]) for n in first), list(first)
    assert not any(n.endswith(TIED[0]) for n in last), list(last)
    (embedding,) = [p for n, p in first.items() if n.endswith(TIED[0])]
    (output,) = [p for n, p in last.items() if n.endswith(TIED[1])]
    return embedding, output


@pytest.mark.parametrize(("engine", "precision"), [(e, p) for p in PRECISIONS for e in ENGINES])
def test_tied_copies_stay_identical_across_stages(runs, engine, precision):
    for when in ("initial", "final"):
        embedding, output = _tied_copies(runs, f"{engine}-pp2-{precision}", when)
        assert torch.equal(embedding, output), (when, (embedding - output).abs().max())


@pytest.mark.parametrize("engine", ENGINES)
def test_interleaved_tied_gives_the_one_rank_run_and_keeps_the_copies(runs, engine):
    name = f"{engine}-interleaved-fp32"
    agree(runs, name, "ref4-ds-fp32", "fp32")
    for when in ("initial", "final"):
        embedding, output = _tied_copies(runs, name, when)
        assert torch.equal(embedding, output), (when, (embedding - output).abs().max())


def test_the_build_syncs_the_tied_copies_and_training_keeps_them(runs):
    # no init_from: the last stage's copy comes from Megatron's build (zeroed, then summed
    # with the first stage's over the embedding group), which the CPU bridge lets run
    for when in ("initial", "final"):
        embedding, output = _tied_copies(runs, "ds-pp2-seeded", when)
        assert torch.equal(embedding, output), when
    assert embedding.abs().max() > 0


@pytest.mark.parametrize(
    "name", [*(f"ref-{e}-{p}" for p in PRECISIONS for e in ENGINES), "ref4-ds-fp32"]
)
def test_clipping_binds_and_the_runs_train(runs, name):
    points = curve(runs, name)
    assert all(norm > CLIP for _, norm in points), points
    assert points[-1][0] < points[0][0] - 0.5, points


def test_the_cpu_bridge_takes_megatrons_cuda_copy_only_in_the_tied_setup():
    # Megatron's ``weight.data.cuda()`` syncing the tied copies at build (the runs above
    # build PP=2 tied models on CPU through it); the tensor method stays torch's elsewhere
    from megatron.core.models.common.language_module.language_module import LanguageModule

    cpu_bridge.install()
    assert hasattr(LanguageModule.setup_embeddings_and_output_layer, "_cpu_bridge_original")
    with pytest.raises((RuntimeError, AssertionError), match="CUDA"):
        torch.zeros(1).cuda()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_1b_runs_zero2_with_overlap_gives_the_one_rank_run(runs, precision):
    """TP=2 + SP under ZeRO-2 with overlap_comm, as the 1B config trains: the same curve
    as one rank (the replica check, on in every run here, keeps the biases equal)."""
    agree(runs, f"ds-tp2sp-zero2-{precision}", f"ref-ds-{precision}", precision)


# -- how many TP all-reduces a step takes ------------------------------------------------
# The DeepSpeed engine sums every TP partial gradient (the row-parallel biases, and what the
# model's own hooks sum: f and dt of the coupling, the norms under SP) in one all-reduce a
# step (engines.deepspeed.when_to_sum_tp_grads): under ZeRO-1 on the accumulated gradients
# before DeepSpeed's data-parallel reduction; under ZeRO-2 with overlap_comm (the 1B run's
# settings) on this rank's partition after it, before the step. Compared with the
# per-parameter hooks, which one run per precision keeps: TP=2 + SP on two ranks (DP=1),
# so each step's 8 sequences are 4 micro-batches of 2. The replica check (on in every run)
# stops a run whose TP copies differ.
MICRO_BATCHES = 4
ONCE_A_STEP = {"zero1": [], "zero2-overlap": ZERO2_OVERLAP}
COUPLED_SP = [*family_overrides("gpt2"), "attention.coupling=hamiltonian", *LAYOUTS["tp2sp"]]
# fp32, final weights against the hooks' after 10 steps: the same sums in another order
# (seen: 1.2e-7 under both ZeRO-1 and ZeRO-2)
WEIGHTS_FP32 = 1e-6


@pytest.fixture(scope="module")
def tp_sum_runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tp-sums")
    seeded = [o for o in _common(str(root), "fp32") if not o.startswith("train.init_from")]
    same = [*(o for o in seeded if not o.startswith("train.precision")), *COUPLED_SP]
    runs = []
    for p in PRECISIONS:
        runs.append((f"hooks-{p}", [*same, f"train.precision={p}"], True))
        for path, settings in ONCE_A_STEP.items():
            runs.append((f"{path}-{p}", [*same, *settings, f"train.precision={p}"], False))
    run_ranks(train_and_count_tp_sums, 2, str(root), runs)
    return root


def _tp_sums(runs: Path, name: str) -> dict:
    assert exits(runs, name) == ["0"], name
    return json.loads(tp_sums_path(runs, name).read_text())


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("path", ONCE_A_STEP)
def test_deepspeed_sums_the_tp_partial_gradients_in_one_all_reduce_a_step(
    tp_sum_runs, path, precision
):
    hooks, once = (_tp_sums(tp_sum_runs, f"{run}-{precision}") for run in ("hooks", path))
    parameters = once["parameters"]
    # two layers: 2 row-parallel biases, 2 LayerNorms (weight, bias), f (2 weights, 1 bias)
    # and dt each; the final LayerNorm
    assert parameters == hooks["parameters"] == 2 * (2 + 4 + 4) + 2, (hooks, once)
    off = worst(tp_sum_runs, f"{path}-{precision}", f"hooks-{precision}")
    print(
        f"\nTP gradient all-reduces a step, DeepSpeed {path} {precision}, TP=2+SP, "
        f"{MICRO_BATCHES} micro-batches, {parameters} parameters: per-parameter hooks "
        f"{hooks['all_reduces'] / STEPS:g}, once a step {once['all_reduces'] / STEPS:g}; "
        f"largest relative difference to the hooks' loss, norm: {off}"
    )
    assert hooks["all_reduces"] == STEPS * MICRO_BATCHES * parameters, hooks
    assert once["all_reduces"] == STEPS, once
    # the same numbers as the hooks' (fp32: up to the order of the sums), and in bf16 the
    # TP sum now adds the fp32 accumulations where the hooks added each bf16 gradient
    agree(tp_sum_runs, f"{path}-{precision}", f"hooks-{precision}", precision)
    if precision == "fp32":
        for rank in (0, 1):
            ours, theirs = (
                _dump(tp_sum_runs, f"{run}-fp32", rank)["final"] for run in (path, "hooks")
            )
            largest = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
            print(f"rank {rank}: largest weight difference {largest:.2g}")
            assert largest <= WEIGHTS_FP32, largest


# configs/runs/1b_4x8.yaml's model at tiny size, in its former DeepSpeed layout: the Llama
# family (RMSNorm, SwiGLU, no biases) with untied embeddings, the coupled variant, TP=2 + SP
# x DP=2, ZeRO-2 with overlap_comm, bf16
SHAPED_LIKE_1B = [
    *family_overrides("llama"),
    "model.tie_embeddings=false",
    "attention.coupling=hamiltonian",
    *LAYOUTS["tp2sp"],
    *ZERO2_OVERLAP,
]


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory) -> Path:
    """TP=2 x DP=2 on four ranks, ZeRO-2 with overlap_comm, fp32: each data-parallel rank's
    partition holds part of the parameters, and one TP partial vector lies across both.
    And the 1B config's combination, in bf16 (``SHAPED_LIKE_1B``)."""
    root = tmp_path_factory.mktemp("tp-sums-dp2")
    seeded = [o for o in _common(str(root), "fp32") if not o.startswith("train.init_from")]
    zero2 = [*seeded, *COUPLED_SP, *ZERO2_OVERLAP]
    runs = [("hooks", zero2, True), ("zero2-overlap", zero2, False)]
    bf16 = [o for o in _common(str(root), "bf16") if not o.startswith("train.init_from")]
    runs += [("hooks-1b", [*bf16, *SHAPED_LIKE_1B], True), ("1b", [*bf16, *SHAPED_LIKE_1B], False)]
    run_ranks(train_and_count_tp_sums, 4, str(root), runs)
    return root


def test_zero2_sums_the_tp_slices_of_each_data_parallel_partition(split_runs):
    hooks, once = (_tp_sums(split_runs, run) for run in ("hooks", "zero2-overlap"))
    micro_batches = MICRO_BATCHES // 2  # a rank's share of each step's sequences
    assert hooks["all_reduces"] == STEPS * micro_batches * once["parameters"], hooks
    assert once["all_reduces"] == STEPS, once
    agree(split_runs, "zero2-overlap", "hooks", "fp32")
    # (data-parallel rank, name, first element, elements): the TP peers (ranks 0 and 1,
    # 2 and 3) summed the same slices, and a parameter split between the partitions was
    # summed in both, each part in its own
    layouts = [_dump(split_runs, "zero2-overlap", rank)["partition"] for rank in range(4)]
    assert layouts[0] == layouts[1] and layouts[2] == layouts[3], layouts
    starts = {name: (start, size) for _, name, start, size in layouts[2]}
    split = [(name, size) for _, name, start, size in layouts[0] if name in starts]
    assert len(split) == 1 and starts[split[0][0]][0] == split[0][1] > 0, (split, starts)
    for rank in range(4):
        ours, theirs = (_dump(split_runs, run, rank)["final"] for run in ("zero2-overlap", "hooks"))
        largest = max((ours[n] - theirs[n]).abs().max().item() for n in theirs)
        assert largest <= WEIGHTS_FP32, (rank, largest)


def test_the_1b_combination_on_four_ranks_sums_once_a_step_as_the_hooks_do(split_runs):
    """The shipped 1B config's combination (``SHAPED_LIKE_1B``) on four ranks: one TP
    all-reduce a step, the per-parameter hooks' curve in bf16, and the replica check (on in
    every run here) found every replicated parameter equal across ranks at every step."""
    hooks, once = (_tp_sums(split_runs, run) for run in ("hooks-1b", "1b"))
    micro_batches = MICRO_BATCHES // 2
    assert once["parameters"] == hooks["parameters"] > 0, (hooks, once)
    assert hooks["all_reduces"] == STEPS * micro_batches * once["parameters"], hooks
    assert once["all_reduces"] == STEPS, once
    print(
        f"\n1B-shaped, 4 ranks, bf16: largest relative difference to the hooks' loss, norm: "
        f"{worst(split_runs, '1b', 'hooks-1b')}"
    )
    agree(split_runs, "1b", "hooks-1b", "bf16")


# engines.deepspeed.TpGradSum's members
HOOKS, BEFORE, AFTER = "HOOKS", "BEFORE_DP_REDUCTION", "AFTER_DP_REDUCTION"


@pytest.mark.parametrize(
    ("settings", "when", "refused"),
    [
        # ZeRO-1 fp32's partition holds the reduced gradients too (summing after also works)
        (["train.zero_stage=1"], BEFORE, []),
        (["train.zero_stage=1", "train.precision=bf16"], BEFORE, [AFTER]),  # BF16_Optimizer
        (["train.zero_stage=1", "train.overlap_grad_reduce=true"], AFTER, [BEFORE]),
        (
            ["train.zero_stage=1", "train.precision=bf16", "train.offload_optimizer=true"],
            HOOKS,
            [BEFORE, AFTER],
        ),
        (["train.zero_stage=2"], AFTER, [BEFORE]),
        (
            ["train.zero_stage=2", "train.precision=bf16", "train.overlap_grad_reduce=true"],
            AFTER,
            [BEFORE],
        ),
        (["train.zero_stage=2", "train.offload_optimizer=true"], HOOKS, [BEFORE, AFTER]),
        (["train.zero_stage=3"], HOOKS, [BEFORE, AFTER]),
    ],
    ids=[
        "z1",
        "z1-bf16",
        "z1-overlap",
        "z1-bf16-offload",
        "z2",
        "z2-bf16-overlap",
        "z2-offload",
        "z3",
    ],
)
def test_the_tp_sum_rule_matches_what_deepspeed_does(settings, when, refused, monkeypatch):
    # In this process (a world of one), the real engine: where the rule sums once a step,
    # DeepSpeed keeps the gradients there (the engine checked it at its start); the check
    # refuses the moments where it does not.
    monkeypatch.setenv("LOCAL_RANK", "0")  # DeepSpeed requires it (torchrun, srun set it)
    from cqk_megatron.model.gpt import build_model
    from cqk_megatron.parallel.process_groups import init_single_process
    from cqk_megatron.training.engines import deepspeed as deepspeed_engine
    from cqk_megatron.training.engines.deepspeed import DeepSpeedEngine, TpGradSum

    init_single_process()
    config = load_config(None, [*TINY, *settings])
    assert deepspeed_engine.when_to_sum_tp_grads(config) is TpGradSum[when]
    torch.manual_seed(config.seed)
    engine = DeepSpeedEngine(build_model(config), config)
    assert engine.megatron_sums.when is TpGradSum[when]
    assert engine.engine.enable_backward_allreduce == (when != BEFORE)
    for moment in refused:
        with pytest.raises(RuntimeError, match="when_to_sum_tp_grads"):
            deepspeed_engine.check_when_to_sum_tp_grads(engine.engine, TpGradSum[moment])


def test_tp_peers_with_other_partition_slices_are_refused():
    from cqk_megatron.training.engines.deepspeed import check_same_slices

    # what the engine's first ZeRO-2 step compares across the TP group (gathered layouts)
    same = [(0, "decoder.final_layernorm.weight", 0, 64)]
    check_same_slices([same, list(same)])
    other = [(0, "decoder.final_layernorm.weight", 16, 48)]
    with pytest.raises(
        RuntimeError, match=r"slice 0 is .*final_layernorm.weight', 0, 64\) on TP rank 0"
    ):
        check_same_slices([same, other])
    with pytest.raises(RuntimeError, match="nothing on TP rank 1"):
        check_same_slices([same, []])
