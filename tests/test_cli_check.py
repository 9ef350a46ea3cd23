"""``cqk check`` (``cqk_megatron/cli/check.py``): the one command that says whether an
install can train. On this CPU machine it must start a real one-rank gloo group and exit
0; what keeps an install from training (a missing DeepSpeed, a CPU torch on a GPU node, a
process group that does not start) must exit 1 naming the fix. The module is tested
directly: the ``cqk`` dispatcher that routes ``cqk check`` to it is wired separately."""

from __future__ import annotations

import pytest

from cqk_megatron.cli import check


def test_this_install_can_train_with_a_real_gloo_group(capsys):
    code = check.main([])
    out = capsys.readouterr().out
    assert code == 0, out
    for name in ("python", "torch", "megatron-core", "deepspeed", "CUDA", "NCCL"):
        assert f"  {name} " in out, (name, out)
    assert "Transformer Engine" in out and "Apex" in out
    assert "gloo group          one rank: started, all_reduce ok" in out
    assert "this install can train (CPU, gloo)" in out
    assert "MISSING" not in out


def test_a_process_group_that_cannot_start_fails_the_check(monkeypatch):
    # gloo refuses an interface that does not exist: the same failure as a cluster node
    # whose name does not resolve, in a real child process.
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuch0")
    probe = check.probe_group("gloo", timeout_s=20)
    assert not probe.ok and "nosuch0" in probe.detail
    facts = _facts(group=probe)
    code, lines = check.verdict(facts)
    assert code == 1
    assert any("one-rank gloo process group did not start" in line for line in lines)
    assert any("GLOO_SOCKET_IFNAME" in line for line in lines)


def test_nccl_without_a_gpu_is_named():
    facts = check.gather(library="nccl", timeout_s=10)
    code, lines = check.verdict(facts)
    assert code == 1
    assert any("NCCL needs a GPU" in line for line in lines), lines


def test_collectives_chooses_the_library_and_the_old_backend_flag_still_does(capsys):
    parser = check.build_parser()
    assert parser.parse_args([]).collectives == "auto"
    assert parser.parse_args(["--collectives", "nccl"]).collectives == "nccl"
    assert parser.parse_args(["--backend", "gloo"]).collectives == "gloo"
    parser.print_help()
    assert "--backend" not in capsys.readouterr().out


def _facts(**changes) -> check.Facts:
    """A CPU install that can train; each test changes one fact."""
    base = dict(
        python="3.11.7",
        torch=check.Package("torch", version="2.13.0+cpu"),
        megatron=check.Package("megatron-core", version="0.16.1"),
        deepspeed=check.Package("deepspeed", version="0.19.8"),
        group=check.GroupProbe("gloo", True, "started, all_reduce ok (0.1 s)"),
    )
    base.update(changes)
    return check.Facts(**base)


def test_the_baseline_facts_can_train():
    assert check.verdict(_facts()) == (0, ["this install can train (CPU, gloo)"])


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        (
            {"deepspeed": check.Package("deepspeed", error="ModuleNotFoundError: deepspeed")},
            "pip install --no-build-isolation deepspeed",
        ),
        (
            {"megatron": check.Package("megatron-core", error="ModuleNotFoundError: megatron")},
            "pip install 'megatron-core>=0.16.1,<0.17'",
        ),
        ({"nvidia_smi": True}, "is a CPU build: training would run on the CPU"),
        ({"torch": check.Package("torch", version="2.4.1")}, "older than 2.5"),
        (
            {"torch": check.Package("torch", error="ModuleNotFoundError: torch")},
            "bash scripts/install.sh",
        ),
        ({"cuda_available": True, "device_count": 8, "torch_cuda": "12.8"}, "has no NCCL"),
    ],
)
def test_what_keeps_an_install_from_training_is_named_with_its_fix(changes, expected):
    code, lines = check.verdict(_facts(**changes))
    assert code == 1
    assert any(expected in line for line in lines), lines


def test_a_gpu_install_can_train_and_notes_the_optional_pieces():
    facts = _facts(
        torch=check.Package("torch", version="2.9.1+cu128"),
        torch_cuda="12.8",
        cuda_available=True,
        device_count=8,
        device_name="NVIDIA H100 80GB HBM3",
        nccl="2.27.3",
        nvidia_smi=True,
        megatron=check.Package("megatron-core", version="0.17.0"),
        group=check.GroupProbe("nccl", True, "started, all_reduce ok (1.0 s)"),
    )
    code, lines = check.verdict(facts)
    assert code == 0
    assert lines[-1] == "this install can train (8 GPU(s), NCCL)"
    assert "note: megatron-core 0.17.0: this stack is tested with 0.16.x" in lines
    assert any("Transformer Engine is not installed" in line for line in lines)
    table = "\n".join(check.report_lines(facts))
    assert "8 GPU(s) visible (NVIDIA H100 80GB HBM3)" in table and "2.27.3" in table


def test_optional_packages_are_found_without_importing_them():
    assert check.installed_version("no_such_module_cqk", ("no-such-module-cqk",)) is None
    assert check.installed_version("yaml", ("PyYAML",)) is not None


def test_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit) as stopped:
        check.main(["--help"])
    assert stopped.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps at any space
    assert "(default: auto)" in out and "(default: 60.0)" in out
