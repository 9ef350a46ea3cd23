"""The training console line shows throughput, MFU and memory, as torchtitan's does: MFU
from the project's FLOPs estimate (perf/flops.py) over ``log.peak_tflops`` (or the GPU's
peak from its name; ``n/a`` on CPU without one), memory as the GPU's peak allocated or, on
CPU, the process's max RSS, labelled as such."""

from __future__ import annotations

import re

from _multiproc import run_ranks
from _training import attempts, records, train_attempts

from cqk_megatron.config import config_errors, load_config
from cqk_megatron.training.metrics import (
    GPU_PEAK_ALLOCATED,
    MAX_RSS,
    StepClock,
    duration,
    train_line,
)

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
    r"step +(\d+)/(?:\d+) \| loss ([\d.]+) \| lr \S+ \| grad [\d.]+ \| ([\d,]+) tok/s"
    r" \| MFU (n/a|[\d.]+%) \| (mem|max RSS) ([\d.]+) GiB \| ETA (n/a|[\dhms]+)$"
)


def test_the_line_shows_tokens_per_second_mfu_and_what_memory_it_measured():
    gpu = train_line({**RECORD, "mfu": 0.41234, "mem_gb": 30.123, "mem_kind": GPU_PEAK_ALLOCATED})
    assert gpu.endswith("| 123,457 tok/s | MFU 41.2% | mem 30.12 GiB"), gpu
    cpu = train_line({**RECORD, "mfu": None, "mem_gb": 1.5, "mem_kind": MAX_RSS})
    assert cpu.endswith("| 123,457 tok/s | MFU n/a | max RSS 1.50 GiB"), cpu


def test_the_line_shows_the_step_of_the_total_and_the_time_left():
    line = train_line({**RECORD, "mem_kind": MAX_RSS}, total=200, eta_s=125.4)
    assert line.startswith("step  12/200 | loss 3.2500"), line
    assert line.endswith("| ETA 2m05s"), line
    assert train_line(RECORD, total=200).endswith("| ETA n/a")  # the first line: no pace yet


def test_the_time_left_is_the_pace_since_the_first_step_logged():
    clock = StepClock()
    assert clock.seconds_left(step=11, total=100, now=1000.0) is None
    assert clock.seconds_left(step=21, total=100, now=1020.0) == 2.0 * 79
    assert clock.seconds_left(step=100, total=100, now=1200.0) == 0.0
    assert [duration(s) for s in (0.4, 59, 60, 187, 3599, 3600, 18240)] == [
        "0s",
        "59s",
        "1m00s",
        "3m07s",
        "59m59s",
        "1h00m",
        "5h04m",
    ]


def test_a_peak_that_is_not_positive_is_refused():
    config = load_config(None, ["log.peak_tflops=0"])
    assert any("log.peak_tflops=0" in e for e in config_errors(config))


def test_training_prints_the_fields_of_its_records(tmp_path):
    """Real training on CPU: with ``log.peak_tflops`` the line's MFU is the record's, which
    is the FLOPs estimate's TFLOP/s per device over that peak; without one it is n/a."""
    base = ["train.train_steps=3", "train.eval_interval=100", "train.checkpoint.save_interval=100"]
    runs = [("peak", [*base, "log.peak_tflops=0.5"]), ("no-peak", base)]
    run_ranks(train_attempts, 1, str(tmp_path), runs)
    for name, peak in (("peak", 0.5), ("no-peak", None)):
        (attempt,) = attempts(tmp_path, name)
        lines = [m for m in map(LINE.match, attempt["stdout"].splitlines()) if m]
        train = records(tmp_path, name, "train")
        assert [int(m[1]) for m in lines] == [r["step"] for r in train] == [1, 2, 3]
        assert all("/3 |" in m[0] for m in lines)  # of train.train_steps
        assert [m[7] == "n/a" for m in lines] == [True, False, False]  # a pace from step 2
        for match, record in zip(lines, train, strict=True):
            assert match[3] == f"{record['tokens_per_s']:,.0f}"
            assert record["mem_kind"] == MAX_RSS and match[5] == "max RSS"
            assert float(match[6]) == round(record["mem_gb"], 2) and record["mem_gb"] > 0
            if peak is None:
                assert match[4] == "n/a" and record["mfu"] is None
            else:
                assert abs(record["mfu"] - record["tflops"] / peak) <= 1e-9 * record["mfu"]
                assert match[4] == f"{100 * record['mfu']:.1f}%"
