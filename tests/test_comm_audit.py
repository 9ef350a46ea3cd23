"""The data-parallel traffic the real engines issue, on gloo ranks at tiny size, against
``perf/traffic.py``'s prediction, for every engine and parallel setting of the shipped run
configs (``configs/runs/*.yaml``), and the Megatron engine under the 1B config's layout.

Each setting trains a tiny model (``_training.TINY``) for two steps with every collective
recorded (``_collective_audit.TrafficRecorder``). Per step, on every rank:

- the gradient reductions and parameter gathers over the data-parallel group move the
  elements ``traffic.dp_collectives`` predicts for the same config (plus at most the
  engines' alignment padding), in the dtype it predicts;
- where the config asks for overlap (``train.overlap_grad_reduce``), at least 80% of the
  gradient-reduction bytes are issued inside the backward, from the second step on: the
  first is Megatron's warm-up (``_ParamAndGradBucketGroup.register_grad_ready`` counts
  each bucket's gradients at ``is_first_batch`` and leaves the reduction to
  ``finish_grad_sync``, after the backward).

A bucket derived from a model's size is larger than a tiny model, so each run sets the
engines' buckets (``traffic.BUCKETS_PER_BACKWARD``) to make as many buckets per backward
as a rank of the shipped config's size makes in the same settings (24 for the 1B config's
TP=1 ranks, 12 for its model at TP=2).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

import pytest
from _comm_audit_workers import recorded_train_runs
from _multiproc import run_ranks
from _training import config_for

from cqk_megatron.config import load_config
from cqk_megatron.perf import traffic

REPO = Path(__file__).resolve().parent.parent
SHIPPED = sorted((REPO / "configs" / "runs").glob("*.yaml"))
DP = 2
STEPS = 2
MAX_MICRO_BATCHES = 4  # the 1B config's 8 cut to 4, to keep the test short
OVERLAPPED_SHARE = 0.8
SPAWN_TIMEOUT_S = 420
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}


def _settings(config) -> dict[str, object]:
    """The engine and parallel settings of a run config, as overrides, and its attention
    variant (which parameters have TP partial gradients)."""
    t, p, a = config.train, config.parallel, config.attention
    return {
        "attention.coupling": a.coupling,
        "attention.scoring": a.scoring,
        "train.engine": t.engine,
        "train.zero_stage": t.zero_stage,
        "train.precision": t.precision,
        "train.overlap_grad_reduce": t.overlap_grad_reduce,
        "parallel.tensor_parallel": p.tensor_parallel,
        "parallel.pipeline_parallel": p.pipeline_parallel,
        "parallel.sequence_parallel": p.sequence_parallel,
    }


def _overrides(settings: dict[str, object] | tuple) -> list[str]:
    items = settings.items() if isinstance(settings, dict) else settings
    return [f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in items]


def _shipped_buckets(config) -> int:
    """Gradient buckets per backward on a rank of the shipped config at its own size."""
    p = config.parallel
    dp = p.data_parallel(p.world_size) if p.world_size else 8
    n = traffic.rank_parameters(config)
    return max(1, math.ceil(n / traffic.reduce_bucket_elements(n, dp)))


def _micro_batches(config) -> int:
    p = config.parallel
    dp = p.data_parallel(p.world_size) if p.world_size else 1
    return max(1, min(MAX_MICRO_BATCHES, traffic.micro_batches(config, dp)))


def _cases() -> dict[str, dict]:
    """One case per distinct setting: {name: {source, overrides, buckets, ranks}}."""
    cases: dict[str, dict] = {}
    seen: dict[tuple, str] = {}
    for path in SHIPPED:
        config = load_config(path, [])
        settings = _settings(config)
        variants = [(path.stem, settings)]
        if path.stem == "1b_4x8":
            # The ladder's larger sizes run the 1B model's settings at TP=2 + SP, and the
            # step-time model ranks DeepSpeed ZeRO-2 there too: both engines' TP sums.
            tp2 = {"parallel.tensor_parallel": 2, "parallel.sequence_parallel": True}
            variants.append((f"{path.stem}-tp2", {**settings, **tp2}))
            zero2 = {"train.engine": "deepspeed", "train.zero_stage": 2}
            variants.append((f"{path.stem}-tp2-zero2", {**settings, **tp2, **zero2}))
        for name, chosen in variants:
            # the variant matters only where TP partial gradients are summed
            key = tuple(
                item
                for item in sorted(chosen.items())
                if chosen["parallel.tensor_parallel"] > 1 or not item[0].startswith("attention")
            )
            if key in seen:  # the same settings as an earlier config's
                cases[seen[key]]["source"] += f", {path.name}"
                continue
            seen[key] = name
            micro = _micro_batches(config)
            # the buckets a rank of the shipped size makes in these settings (a TP=2 rank
            # holds half the model, so half the buckets of a TP=1 rank)
            at_size = load_config(path, _overrides(chosen))
            overrides = _overrides(key)
            overrides += [
                "parallel.world_size=null",
                "train.micro_batch_size=2",
                f"train.global_batch_size={2 * DP * micro}",
                f"train.train_steps={STEPS}",
                "train.eval_interval=100",
                "train.checkpoint.save_interval=100",
                "train.resilience.check_replicas_interval=0",
            ]
            ranks = DP * chosen["parallel.tensor_parallel"] * chosen["parallel.pipeline_parallel"]
            cases[name] = {
                "source": path.name,
                "overrides": overrides,
                "buckets": _shipped_buckets(at_size),
                "ranks": ranks,
            }
    return cases


CASES = _cases()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("comm-audit")
    by_ranks: dict[int, list] = defaultdict(list)
    for name, case in CASES.items():
        by_ranks[case["ranks"]].append((name, case["overrides"], case["buckets"]))
    for ranks, runs in sorted(by_ranks.items()):
        run_ranks(recorded_train_runs, ranks, str(root), runs, timeout_s=SPAWN_TIMEOUT_S)
    return root


def _dp_traffic(record: dict) -> dict[int, list[dict]]:
    """Per step, the engines' collectives over the data-parallel group, scalars aside."""
    steps: dict[int, list[dict]] = defaultdict(list)
    for call in record["calls"]:
        if (
            call["step"] is not None
            and call["group"] == record["dp_group"]
            and call["kind"] in traffic.KINDS
            and call["elements"] > 1
            and not call["caller"].startswith("cqk_megatron/training/collectives.py")
        ):
            steps[call["step"]].append(call)
    return steps


def _padding_bound(config, tensors: int, buckets: int) -> int:
    """The most alignment padding the engines add (``perf/traffic.py``'s docstring)."""
    if config.train.engine == "megatron":
        return 64 * tensors + math.lcm(DP, 128) * buckets
    return 2 * DP * traffic.DEEPSPEED_PARAM_GROUPS


def _describe(name: str, case: dict, config) -> str:
    t, p = config.train, config.parallel
    engine = f"ZeRO-{t.zero_stage}" if t.engine == "deepspeed" else "Megatron distopt"
    sp = " SP" if p.sequence_parallel else ""
    return (
        f"{name} (the settings of {case['source']}: {engine} {t.precision}"
        f"{' overlap' if t.overlap_grad_reduce else ''}, TP={p.tensor_parallel}{sp} "
        f"PP={p.pipeline_parallel} DP={DP}, {traffic.micro_batches(config, DP)} micro-batches)"
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_data_parallel_traffic_is_the_predicted_and_overlapped(recorded, name, monkeypatch):
    case = CASES[name]
    monkeypatch.setattr(traffic, "BUCKETS_PER_BACKWARD", case["buckets"])
    config = config_for(str(recorded), name, case["overrides"])
    predicted = traffic.dp_collectives(config, DP)
    what = _describe(name, case, config)
    for path in sorted(recorded.glob(f"{name}-rank*.json")):
        record = json.loads(path.read_text())
        elements, tensors = record["parameters"]
        assert elements == traffic.rank_parameters(config), f"{what}: {path.name}"
        steps = _dp_traffic(record)
        assert sorted(steps) == list(range(STEPS)), f"{what}: {path.name}: steps {sorted(steps)}"
        for step, calls in steps.items():
            where = f"{what}, {path.stem.rsplit('-', 1)[1]}, step {step}"
            if path.stem.endswith("rank0") and step == STEPS - 1:
                print(f"\n{where}: {_summary(calls)}")
            _check_step(config, predicted, calls, tensors, where, warm_up=step == 0)


def _summary(calls: list[dict]) -> str:
    """Each kind's calls, elements, dtypes and share of bytes issued inside the backward."""
    parts = []
    for kind in traffic.KINDS:
        seen = [c for c in calls if c["kind"] == kind]
        if seen:
            elements = sum(c["elements"] for c in seen)
            inside = sum(c["elements"] for c in seen if c["in_backward"])
            dtypes = "/".join(sorted({c["dtype"] for c in seen}))
            parts.append(
                f"{len(seen)} {kind} of {elements:,} {dtypes} elements, "
                f"{inside / elements:.0%} inside the backward"
            )
    return "; ".join(parts)


def _check_step(config, predicted, calls, tensors, where: str, warm_up: bool) -> None:
    for expected_what in {c.what for c in predicted}:
        expected = [c for c in predicted if c.what == expected_what]
        kind, dtype = expected[0].kind, expected[0].dtype
        seen = [c for c in calls if c["kind"] == kind]
        got = sum(c["elements"] for c in seen)
        want = sum(c.elements for c in expected)
        bound = _padding_bound(config, tensors, len(seen))
        assert want <= got <= want + bound and {c["dtype"] for c in seen} == {dtype}, (
            f"{where}: {expected_what}: {got:,} elements in {len(seen)} {kind} calls of "
            f"{sorted({c['dtype'] for c in seen})}; perf/traffic.py predicts {want:,} {dtype} "
            f"(+ at most {bound:,} padding) in {sum(c.calls for c in expected)} calls"
        )
    if not config.train.overlap_grad_reduce or warm_up:
        return
    kind = next(c.kind for c in predicted if c.what == "gradient reduction")
    reductions = [c for c in calls if c["kind"] == kind]
    total = sum(c["elements"] * DTYPE_BYTES[c["dtype"]] for c in reductions)
    inside = sum(c["elements"] * DTYPE_BYTES[c["dtype"]] for c in reductions if c["in_backward"])
    assert inside >= OVERLAPPED_SHARE * total, (
        f"{where}: train.overlap_grad_reduce asks for overlap, yet {inside:,} of {total:,} "
        f"gradient-reduction bytes ({inside / total:.0%}) are issued inside the backward, in "
        f"{sum(c['in_backward'] for c in reductions)} of {len(reductions)} {kind} calls "
        f"(at least {OVERLAPPED_SHARE:.0%} needed)"
    )


PERFORMANCE_DOC = REPO / "docs" / "performance.md"
PLURAL = {"all_reduce": "all-reduces", "reduce_scatter": "reduce-scatters"}


def _documented_now(name: str) -> str:
    """The "now" cell of ``name``'s data-parallel row in docs/performance.md's audit table."""
    rows = [
        line
        for line in PERFORMANCE_DOC.read_text().splitlines()
        if line.startswith("|") and f"(`{name}`)" in line and "TP sums" not in line
    ]
    assert len(rows) == 1, f"docs/performance.md: no one audit row for `{name}`: {rows}"
    return rows[0].split("|")[-2].strip()


@pytest.mark.parametrize("name", [n for n in sorted(CASES) if n.startswith("1b_4x8")])
def test_the_audit_numbers_in_the_docs_are_what_the_engines_send(recorded, name):
    """docs/performance.md's table gives each 1B case's gradient reduction as recorded:
    calls, dtype, elements and the share issued inside the backward, on rank 0's last step."""
    config = config_for(str(recorded), name, CASES[name]["overrides"])
    kind = next(
        c.kind for c in traffic.dp_collectives(config, DP) if c.what == "gradient reduction"
    )
    record = json.loads((recorded / f"{name}-rank0.json").read_text())
    calls = [c for c in _dp_traffic(record)[STEPS - 1] if c["kind"] == kind]
    elements = sum(c["elements"] for c in calls)
    inside = sum(c["elements"] for c in calls if c["in_backward"])
    dtypes = "/".join(sorted({c["dtype"] for c in calls}))
    recorded_now = (
        f"{len(calls)} {dtypes} {PLURAL[kind]} of {elements:,} elements, "
        f"{inside / elements:.0%} inside the backward"
    )
    assert _documented_now(name) == recorded_now


TP_GRADS = "cqk_megatron/model/attention/tp_grads.py"


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if "tensor_parallel=2" in str(c)])
def test_the_tp_partial_gradients_are_summed_once_a_step_in_fp32(recorded, name):
    """Both engines sum the gradients of the parameters whole on every TP rank (``f``,
    ``dt``, the norms under SP) in one fp32 all-reduce a step, not one per parameter and
    micro-batch in the parameters' dtype (``attention/tp_grads.py``)."""
    for path in sorted(recorded.glob(f"{name}-rank*.json")):
        record = json.loads(path.read_text())
        sums = [c for c in record["calls"] if c["caller"].startswith(TP_GRADS)]
        per_step = defaultdict(list)
        for call in sums:
            per_step[call["step"]].append(call)
        found = {
            step: (len(calls), sorted({c["dtype"] for c in calls}))
            for step, calls in per_step.items()
        }
        assert found == {step: (1, ["fp32"]) for step in range(STEPS)}, (
            f"{name}, {path.stem}: TP-sum all-reduces per step (calls, dtypes): {found}"
        )


# -- the rules, without processes ----------------------------------------------------------


@pytest.mark.parametrize("size", ["60m", "150m", "350m", "1b", "3b", "7b"])
@pytest.mark.parametrize("dp", [8, 64])
def test_buckets_fill_during_the_backward_at_every_ladder_size(size, dp):
    config = load_config(REPO / "configs" / "models" / f"{size}.yaml", [])
    parameters = traffic.rank_parameters(config)
    bucket = traffic.reduce_bucket_elements(parameters, dp)
    assert bucket <= max(40_000_000, 1_000_000 * dp)  # Megatron-LM's rule at most
    assert parameters / bucket >= traffic.BUCKETS_PER_BACKWARD - 1e-9


def test_deepspeed_gets_the_buckets():
    from cqk_megatron.training.engines.deepspeed import deepspeed_config

    config = load_config(REPO / "configs" / "runs" / "1b_4x8.yaml", [])
    zero = deepspeed_config(config, 8, 40_000_000)["zero_optimization"]
    assert zero["reduce_bucket_size"] == zero["allgather_bucket_size"] == 40_000_000


@pytest.mark.parametrize(("engine", "gloo"), [("deepspeed", False), ("megatron", True)])
def test_megatrons_gloo_groups_only_for_the_engine_that_uses_them(engine, gloo):
    from megatron.core import parallel_state as ps

    from cqk_megatron.parallel.process_groups import init_single_process

    init_single_process(load_config(None, [f"train.engine={engine}"]))
    # private, megatron-core is pinned: get_data_parallel_group_gloo asserts it exists
    assert (ps._DATA_PARALLEL_GROUP_GLOO is not None) is gloo
    assert (ps._DATA_PARALLEL_GROUP_WITH_CP_GLOO is not None) is gloo
