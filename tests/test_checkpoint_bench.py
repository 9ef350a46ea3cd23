"""The checkpoint benchmark (``cqk bench checkpoints``: cqk_megatron/bench/checkpoints.py)
at a tiny size: the shape of its output, not its timings."""

from __future__ import annotations

from cqk_megatron.__main__ import main as cqk
from cqk_megatron.bench import checkpoints as checkpoint_bench

PARTS = {"staging", "writing", "hashing", "manifest", "load", "stall", "hashing_share", "bytes"}


def test_the_benchmark_reports_each_part_for_each_kind_of_save(capsys):
    assert cqk(["bench", "checkpoints", "--hidden", "32", "--layers", "1", "--vocab", "64"]) == 0
    result = checkpoint_bench.measure(32, 1, 64)
    assert result["parameters"] == 64 * 32 + 12 * 32 * 32
    assert len(result["measured"]) == 3
    for label, times in result["measured"].items():
        assert set(times) == PARTS, label
        assert times["bytes"] > 14 * result["parameters"]  # bf16 weights + fp32 master, moments
        asynchronous = label.startswith("async")
        assert times["stall"] == (times["staging"] if asynchronous else times["stall"])
    cluster = checkpoint_bench.cluster_estimate()
    assert len(cluster) == 2
    for estimate in cluster.values():
        assert set(estimate["stall_fraction_of_interval"]) == {
            "sync, sha256 on rank 0 (before)",
            "sync, xxh3 per rank",
            "async, xxh3 per rank",
        }
    printed = capsys.readouterr().out
    assert "staging" in printed and "hashing" in printed and "1B" in printed and "7B" in printed
