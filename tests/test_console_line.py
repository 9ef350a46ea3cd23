"""The training console line shows throughput, MFU and memory, as torchtitan's does: MFU
from the project's FLOPs estimate (perf/flops.py) over ``log.peak_tflops`` (or the GPU's
peak from its name; ``n/a`` on CPU without one), memory as the GPU's peak allocated or, on
CPU, the process's max RSS, labelled as such."""

from __future__ import annotations

import re

from _multiproc import run_ranks
from _training import attempts, records, train_attempts

from cqk_megatron.config import config_errors, load_config
from cqk_megatron.training.metrics import GPU_PEAK_ALLOCATED, MAX_RSS, train_line

RECORD = {
    "kind": "train",
    "step": 12,
    "loss": 3.25,
    "lr": 3e-4,
    "grad_norm": 0.75,
    "tokens_per_s": 123456.7,
    "tflops": 400.0,
}
LINE = re.compile(
    r"step +(\d+) \| loss ([\d.]+) \| lr \S+ \| grad [\d.]+ \| ([\d,]+) tok/s"
    r" \| MFU (n/a|[\d.]+%) \| (mem|max RSS) ([\d.]+) GiB$"
)


def test_the_line_shows_tokens_per_second_mfu_and_what_memory_it_measured():
    gpu = train_line({**RECORD, "mfu": 0.41234, "mem_gb": 30.123, "mem_kind": GPU_PEAK_ALLOCATED})
    assert gpu.endswith("| 123,457 tok/s | MFU 41.2% | mem 30.12 GiB"), gpu
    cpu = train_line({**RECORD, "mfu": None, "mem_gb": 1.5, "mem_kind": MAX_RSS})
    assert cpu.endswith("| 123,457 tok/s | MFU n/a | max RSS 1.50 GiB"), cpu


def test_a_peak_that_is_not_positive_is_refused():
    config = load_config(None, ["log.peak_tflops=0"])
    assert any("log.peak_tflops=0" in e for e in config_errors(config))


def test_training_prints_the_fields_of_its_records(tmp_path):
    """Real training on CPU: with ``log.peak_tflops`` the line's MFU is the record's, which
    is the FLOPs estimate's TFLOP/s per device over that peak; without one it is n/a."""
    base = ["train.train_steps=3", "train.eval_interval=100", "train.save_interval=100"]
    runs = [("peak", [*base, "log.peak_tflops=0.5"]), ("no-peak", base)]
    run_ranks(train_attempts, 1, str(tmp_path), runs)
    for name, peak in (("peak", 0.5), ("no-peak", None)):
        (attempt,) = attempts(tmp_path, name)
        lines = [m for m in map(LINE.match, attempt["stdout"].splitlines()) if m]
        train = records(tmp_path, name, "train")
        assert [int(m[1]) for m in lines] == [r["step"] for r in train] == [1, 2, 3]
        for match, record in zip(lines, train, strict=True):
            assert match[3] == f"{record['tokens_per_s']:,.0f}"
            assert record["mem_kind"] == MAX_RSS and match[5] == "max RSS"
            assert float(match[6]) == round(record["mem_gb"], 2) and record["mem_gb"] > 0
            if peak is None:
                assert match[4] == "n/a" and record["mfu"] is None
            else:
                assert abs(record["mfu"] - record["tflops"] / peak) <= 1e-9 * record["mfu"]
                assert match[4] == f"{100 * record['mfu']:.1f}%"
