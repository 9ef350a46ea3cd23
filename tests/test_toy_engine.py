"""An engine from outside the package: registered from this file alone, as a user's would
be from theirs, it trains, saves and resumes a tiny run through the real training loop
on two gloo ranks.

The toy engine is plain ``torch.optim.AdamW`` on every rank, data parallel by an
all-reduce of the gradients; its spec adds no rules and trains with the ``ddp``
sharding. An unknown ``train.engine`` is refused with one line naming the registered
engines.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _multiproc import run_ranks
from _training import config_for, records, set_rank_env, synthetic_datasets
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps

from cqk_megatron.config import ConfigError, load_config, validate
from cqk_megatron.model.gpt import load_sharded_state, sharded_state_dict
from cqk_megatron.run.checkpoint_files import latest_name
from cqk_megatron.training.engines import (
    DDP,
    EngineSpec,
    UnknownEngineError,
    engine_names,
    engine_spec,
    register_engine,
)
from cqk_megatron.training.engines.protocol import Batch, Engine, StepResult
from cqk_megatron.training.step_loss import forward, global_mean_loss, lm_loss

REPO = Path(__file__).resolve().parent.parent
SHIPPED = {"deepspeed", "megatron"}
LOADED = "toy-loaded.json"  # what the toy engine's load_state found (rank 0)


class ToyEngine(Engine):
    """AdamW over this rank's whole model; gradients averaged over data parallel."""

    def __init__(self, model: torch.nn.Module, config) -> None:
        t = config.train
        self.model, self.clip = model, t.optimizer.clip_grad or float("inf")
        self.root = Path(config.log.root)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            self.params,
            lr=t.optimizer.lr,
            betas=(t.optimizer.beta1, t.optimizer.beta2),
            eps=t.optimizer.eps,
            weight_decay=t.optimizer.weight_decay,
        )

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(self, micro_batches: list[Batch]) -> StepResult:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=False)
        loss_sum = torch.zeros((), dtype=torch.float64)
        for batch in micro_batches:
            loss = lm_loss(forward(self.model, batch), batch["loss_mask"])
            (loss / len(micro_batches)).backward()
            loss_sum += loss.detach().double()
        group, dp = ps.get_data_parallel_group(), ps.get_data_parallel_world_size()
        for param in self.params:
            dist.all_reduce(param.grad, group=group)
            param.grad /= dp
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.clip))
        self.optimizer.step()
        return StepResult(global_mean_loss(loss_sum, len(micro_batches)), grad_norm, False)

    @torch.no_grad()
    def eval_loss(self, micro_batches: list[Batch]) -> float:
        self.model.eval()
        losses = [lm_loss(forward(self.model, b), b["loss_mask"]) for b in micro_batches]
        return global_mean_loss(torch.stack(losses).double().sum(), len(micro_batches))

    def _file(self, folder: Path) -> Path:
        return folder / f"adamw-dp{ps.get_data_parallel_rank()}.pt"

    def save_state(self, folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(self.optimizer.state_dict(), self._file(folder))

    def load_state(self, folder: Path, model_folder: Path) -> None:
        # the weights: the checkpoint's layout-free copy (this engine keeps none of its own)
        weights = dist_checkpointing.load(sharded_state_dict(self.model), str(model_folder))
        load_sharded_state(self.model, weights)
        state = torch.load(self._file(folder), weights_only=True)
        self.optimizer.load_state_dict(state)
        if dist.get_rank() == 0:
            steps = {int(s["step"]) for s in self.optimizer.state_dict()["state"].values()}
            loaded = {"adam_steps": sorted(steps), "file": self._file(folder).name}
            (self.root / LOADED).write_text(json.dumps(loaded))


class ToySpec(EngineSpec):
    engine = ToyEngine
    shardings = {DDP: 0}  # one sharding: any train.zero_stage selects it
    settings = ("optimizer",)  # train.optimizer: AdamW's settings
    checkpoint_format = "torch.optim.AdamW state_dict, one file per data-parallel rank"


register_engine("toy", ToySpec())

SHORT = [
    "train.engine=toy",
    "train.train_steps=6",
    "train.checkpoint.save_interval=2",
    "train.eval_interval=2",
]


def _train_resume_and_straight(rank, world_size, port, root) -> None:
    set_rank_env(rank, world_size, port)
    from cqk_megatron.training.loop import train

    stop = "train.resilience.exit_after_steps=4"  # saves at step 4 and exits for a requeue
    for name, overrides, code in (("resumed", [stop], 75), ("resumed", [], 0), ("straight", [], 0)):
        config = config_for(root, name, [*SHORT, *overrides])
        assert train(config, datasets=synthetic_datasets(config)) == code


@pytest.mark.multiprocess
def test_a_toy_engine_trains_saves_and_resumes_through_the_loop(tmp_path):
    run_ranks(_train_resume_and_straight, 2, str(tmp_path), timeout_s=600)
    # the second run resumed from step 4's checkpoint with the toy's AdamW state
    assert json.loads((tmp_path / LOADED).read_text()) == {
        "adam_steps": [4],
        "file": "adamw-dp0.pt",
    }
    resumed = records(tmp_path, "resumed", "train")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4, 5, 6]
    straight = records(tmp_path, "straight", "train")
    # steps 5 and 6 as in the uninterrupted run: the weights, the optimizer state (step 6
    # follows step 5's Adam update) and the schedule came back
    assert [r["loss"] for r in resumed] == pytest.approx([r["loss"] for r in straight], rel=1e-6)
    checkpoints = tmp_path / "resumed" / "checkpoints"
    newest = checkpoints / str(latest_name(checkpoints))
    layout = json.loads((newest / "layout.json").read_text())
    assert (layout["engine"], layout["zero_stage"], layout["data_parallel"]) == ("toy", 0, 2)
    assert sorted(p.name for p in (newest / "engine").iterdir()) == [
        "adamw-dp0.pt",
        "adamw-dp1.pt",
    ]


def test_an_unknown_engine_is_refused_with_one_line_naming_the_registered_ones():
    assert engine_names() == ["deepspeed", "megatron", "toy"]
    with pytest.raises(ConfigError) as refused:
        validate(load_config(None, ["train.engine=tyo"]))
    line = "train.engine='tyo' is unknown; choose one of ['deepspeed', 'megatron', 'toy']"
    assert str(refused.value) == f"invalid config:\n  - {line}"
    with pytest.raises(
        UnknownEngineError, match=r"choose one of \['deepspeed', 'megatron', 'toy'\]"
    ):
        engine_spec("tyo")


# -- nothing outside the engines compares an engine's name -----------------------------------


def _names_in(node: ast.AST) -> set[str]:
    """Engine names that ``node`` spells as a string (or a tuple/list/set of them)."""
    if isinstance(node, ast.Constant) and node.value in SHIPPED:
        return {node.value}
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_names_in(item) for item in node.elts))
    return set()


def _is_mqar_model(node: ast.AST) -> bool:
    # the MQAR probe's ``--model megatron|plain`` names a model, not an engine
    return isinstance(node, ast.Attribute) and node.attr == "model"


def engine_name_comparisons(path: Path) -> list[str]:
    """``file:line: code`` for each comparison (``==``, ``!=``, ``in``, ``match``) of a
    value with a shipped engine's name in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = set()
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if not any(_is_mqar_model(operand) for operand in operands):
                names = set().union(*map(_names_in, operands))
        elif isinstance(node, ast.MatchValue):
            names = _names_in(node.value)
        if names:
            where = path.relative_to(REPO) if REPO in path.parents else path
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_code_outside_the_engines_compares_an_engine_name(tmp_path):
    engines = REPO / "cqk_megatron" / "training" / "engines"
    files = [
        path
        for folder in ("launch", "cqk_megatron", "data_tools")
        for path in sorted((REPO / folder).rglob("*.py"))
        if engines not in path.parents
    ]
    found = [line for path in files for line in engine_name_comparisons(path)]
    assert not found, "ask the engine's spec instead:\n" + "\n".join(found)
    # and the scan sees what it looks for
    sample = tmp_path / "probe.py"
    sample.write_text('if t.engine == "megatron" or e in ("x", "deepspeed"):\n    pass\n')
    assert len(engine_name_comparisons(sample)) == 2
