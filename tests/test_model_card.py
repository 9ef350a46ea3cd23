"""The exported model card carries the Hub's license, datasets and base-model metadata:
from the run config's ``card`` section, or from ``cqk-convert export``'s ``--license``,
``--datasets`` and ``--base-model``, which win. Read back with huggingface_hub's own
``ModelCard`` parser, as the Hub reads it."""

from __future__ import annotations

import _tiny
import pytest
import torch

from cqk_megatron.cli.convert import main as cli_main
from cqk_megatron.config import load_config
from cqk_megatron.convert.model_card import model_card
from cqk_megatron.model.gpt import build_model
from cqk_megatron.parallel.process_groups import init_single_process

hub = pytest.importorskip("huggingface_hub")

CARD = ["card.license=apache-2.0", "card.datasets=[HuggingFaceFW/fineweb]", "card.base_model=a/b"]


def card_data(text: str) -> dict:
    return hub.ModelCard(text).data.to_dict()


def test_the_card_s_metadata_comes_from_the_run_config():
    data = card_data(model_card(load_config(None, CARD), 1000))
    assert data["license"] == "apache-2.0"
    assert data["datasets"] == ["HuggingFaceFW/fineweb"]
    assert data["base_model"] == "a/b"
    assert data["library_name"] == "transformers" and "cqk-megatron" in data["tags"]
    unset = card_data(model_card(load_config(None, []), 1000))  # nothing made up
    assert not {"license", "datasets", "base_model"} & set(unset)


def test_export_flags_win_over_the_run_config(tmp_path):
    from cqk_megatron.convert.checkpoint_io import write_full_state_dict

    init_single_process()
    config = _tiny.tiny_config("coupled", *CARD, vocab=100, seq=16, precision="fp32")
    torch.manual_seed(0)
    state = {n: p.detach().clone() for n, p in build_model(config).named_parameters()}
    checkpoints = tmp_path / "run" / "checkpoints"
    write_full_state_dict(state, config, checkpoints / "iter_0000003")
    (checkpoints / "latest").write_text("iter_0000003\n")

    from_config = tmp_path / "from-config"
    assert cli_main(["export", str(tmp_path / "run"), str(from_config), "--no-tokenizer"]) == 0
    data = card_data((from_config / "README.md").read_text())
    assert (data["license"], data["datasets"], data["base_model"]) == (
        "apache-2.0",
        ["HuggingFaceFW/fineweb"],
        "a/b",
    )
    flags = ["--license", "mit", "--datasets", "x/one", "x/two", "--base-model", "c/d"]
    out = tmp_path / "from-flags"
    assert cli_main(["export", str(tmp_path / "run"), str(out), "--no-tokenizer", *flags]) == 0
    data = card_data((out / "README.md").read_text())
    assert (data["license"], data["datasets"], data["base_model"]) == (
        "mit",
        ["x/one", "x/two"],
        "c/d",
    )
    recorded = load_config(out / "cqk_run_config.yaml").card  # the export records them too
    assert (recorded.license, recorded.datasets, recorded.base_model) == (
        "mit",
        ["x/one", "x/two"],
        "c/d",
    )


def test_model_card_is_under_80_lines():
    import inspect

    lines = inspect.getsource(model_card).splitlines()
    assert len(lines) < 80, len(lines)
