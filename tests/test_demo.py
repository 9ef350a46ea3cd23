"""The README's demo, shortened (8 steps per run, the same path through every stage), from
an environment chosen by VENV: the mini-ladder goes through the launcher as one sweep
(job records and one run folder per size and variant), the report fits L(N, D) for both
variants with bootstrap intervals, the coupled export loads, a second run skips what is
done; and .ci/run takes its Python from VENV too."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch.run_dir import is_finished

REPO = Path(__file__).resolve().parents[1]
STEPS = 8
SIZES = ("w64", "w96", "w128")  # configs/sweeps/demo.yaml
VARIANTS = ("standard", "coupled")
PARAMS = ("E", "A", "B", "alpha", "beta")


def elsewhere_venv(folder: Path, real_python: str) -> tuple[Path, Path]:
    """A VENV at another path whose python logs every call and then runs ``real_python``
    (the installed environment): the scripts must reach it through VENV alone."""
    log = folder / "calls.log"
    python = folder / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\nexec "{real_python}" "$@"\n')
    python.chmod(0o755)
    return folder, log


def demo_env(out: Path, venv: Path) -> dict[str, str]:
    return {
        **os.environ,
        "VENV": str(venv),
        "DEMO_OUT": str(out),
        "DEMO_STEPS": str(STEPS),
        "DEMO_BOOTSTRAP": "40",
        "DEMO_SKIP_INSTALL": "1",
    }


def run_demo(out: Path, venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        env=demo_env(out, venv),
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=REPO,
    )


def _sigint_as_on_a_terminal() -> None:  # in the demo's shell, before it starts
    # A job started in the background of a non-interactive shell (a CI script's `... &`)
    # inherits SIGINT ignored, and a shell that starts with it ignored cannot undo that:
    # Ctrl-C below would then do nothing. A terminal's foreground job has the default.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def interrupt_demo(out: Path, venv: Path) -> tuple[int, str]:
    """Start the demo as a terminal does (its own process group) and press Ctrl-C (SIGINT
    to the whole group) once a run has written its first complete checkpoint."""
    log = out.parent / "interrupted.log"
    with log.open("w") as handle:
        demo = subprocess.Popen(
            ["bash", str(REPO / "scripts" / "demo.sh")],
            env=demo_env(out, venv),
            stdout=handle,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            start_new_session=True,
            preexec_fn=_sigint_as_on_a_terminal,
        )
        try:
            deadline = time.monotonic() + 900
            # iter_ + 7 digits: a complete folder, not a staging iter_NNNNNNN.tmp
            while not list((out / "runs").glob("*/checkpoints/iter_???????")):
                assert demo.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint within 900 s"
                time.sleep(0.5)
            os.killpg(demo.pid, signal.SIGINT)
            code = demo.wait(timeout=300)
        finally:
            if demo.poll() is None:
                os.killpg(demo.pid, signal.SIGKILL)
                demo.wait()
    return code, log.read_text()


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that name ``text`` (a run folder, say)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and proc.name != str(os.getpid()):
            found.append(cmdline)
    return found


def fit_rows(report: str) -> dict[str, list[str]]:
    """The L(N, D) fit table's rows by variant: the cells of E, A, B, alpha, beta."""
    section = report.split("## Scaling-law fits", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|")), strict=True))
        rows[cells["variant"]] = [cells[name] for name in PARAMS]
    return rows


def test_demo_ladder_end_to_end(tmp_path):
    out = tmp_path / "demo"
    venv, calls = elsewhere_venv(tmp_path / "elsewhere", sys.executable)

    # Ctrl-C after the first checkpoint: the launcher cancels its local jobs (each saves)
    # and says how to go on; no process of the demo is left training.
    code, interrupted = interrupt_demo(out, venv)
    assert code != 0, interrupted[-3000:]
    assert "run the same command again to resume" in interrupted, interrupted[-3000:]
    assert "Traceback" not in interrupted, interrupted[-3000:]
    assert not processes_mentioning(str(out / "runs")), processes_mentioning(str(out / "runs"))

    # A run can finish in the moment between its last (and only) checkpoint, which sends
    # the Ctrl-C, and the Ctrl-C itself: the next command skips it and submits the others.
    names = {f"demo-{size}-{variant}-s0" for size in SIZES for variant in VARIANTS}
    finished = {name for name in names if is_finished(out / "runs" / name, STEPS)}
    assert len(finished) < len(names), "every run finished before Ctrl-C: nothing to resume"

    result = run_demo(out, venv)  # the same command: resumes, then finishes every stage
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    # every stage ran on VENV's python (nothing on a hard-coded .venv)
    called = calls.read_text()
    for stage in ("data_tools.demo_corpus", "launch/submit.py --sweep", "cqk_megatron.analysis"):
        assert stage in called, called

    # one sweep through the launcher: a run folder per size and variant, with job records
    assert {p.name for p in (out / "runs").iterdir() if p.is_dir()} >= names
    for name in names:
        run = out / "runs" / name
        events = [json.loads(line) for line in (run / "jobs.jsonl").read_text().splitlines()]
        kinds = [e["event"] for e in events]
        assert kinds[0] == "submitted" and "started" in kinds and kinds[-1] == "finished"
        assert "--sweep" in events[0]["command"]
        assert list((run / "submitit").glob("*_0_log.out"))
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in records if r["kind"] == "train"]
        assert [r["step"] for r in train] == list(range(1, STEPS + 1))
        assert all(r["process_cpu_s"] > 0 for r in train)
        assert len([r for r in records if r["kind"] == "valid"]) >= 4  # evaluates 4 times
        assert records[-1]["kind"] == "summary"
        assert (run / "checkpoints" / "latest").read_text().strip() == f"iter_{STEPS:07d}"
    # the runs Ctrl-C stopped went on from their checkpoints (and, above, no step twice)
    resumed = [
        name
        for name in names
        if any(
            "resumed from" in log.read_text()
            for log in (out / "runs" / name).glob("submitit/*_log.out")
        )
    ]
    assert resumed, "no run resumed after Ctrl-C"
    # the sweep's own progress, over the runs it submitted; the others it said it skipped
    submitted = len(names) - len(finished)
    assert f"[{submitted}/{submitted} ended]" in result.stdout, result.stdout[-3000:]
    for name in finished:
        assert f"skipped {name}: " in result.stdout, result.stdout[-3000:]

    # the analysis: an L(N, D) fit per variant; the size term, which three sizes cannot
    # fix, "not identified"; the token term an interval that contains its point, or "not
    # identified" where it spans more than a decade (eight steps a run fix little)
    report = (out / "report" / "report.md").read_text()
    rows = fit_rows(report)
    assert set(rows) == set(VARIANTS), rows
    interval = re.compile(r"^(\S+) \[(\S+), (\S+)\]$")
    for variant, cells in rows.items():
        for name, cell in zip(PARAMS, cells, strict=True):
            if name in ("E", "A", "alpha"):
                assert cell == "not identified by these runs", (variant, name, cell)
                continue
            if cell == "not identified by these runs":
                continue
            found = interval.match(cell)
            assert found, (variant, name, cell)
            point, low, high = map(float, found.groups())
            assert low <= point <= high, (variant, name, cell)
    for heading in (
        "## Data-efficiency multiplier over standard attention",
        "## Loss vs compute",
        "## What these fits can and cannot mean",
    ):
        assert heading in report, heading
    assert "measured: the size's N and training tokens" in report
    assert "(CPU" in report  # step time from process CPU time
    for figure in ("loss_curves", "fits_loss_vs_tokens", "loss_vs_compute", "multiplier_vs_size"):
        png = out / "report" / "figures" / f"{figure}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", figure
    assert "Done. Where everything is" in result.stdout

    # the largest coupled model's Hugging Face folder loads in a fresh process, offline
    hf = out / "hf" / "demo-w128-coupled-s0"
    check = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from transformers import AutoModelForCausalLM as M; "
            "m = M.from_pretrained(sys.argv[1], trust_remote_code=True); "
            "print(type(m).__name__, m.config.vocab_size)",
            str(hf),
        ],
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert check.stdout.split()[0] == "CQKForCausalLM"

    written = (out / "report" / "report.md").stat().st_mtime_ns
    again = run_demo(out, venv)  # finished runs are skipped, nothing is retrained
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    for name in names:
        assert f"skipped {name}: finished" in again.stdout
    assert "nothing submitted" in again.stdout
    # and the report of those same runs is not made again
    assert "skipped: the report of these runs is there already" in again.stdout
    assert (out / "report" / "report.md").stat().st_mtime_ns == written
    assert "## Scaling-law fits" in again.stdout  # its tables are still shown


def test_ci_takes_its_python_from_venv(tmp_path):
    """.ci/run with VENV=elsewhere (relative to where it is started): the install and the
    test run both go to that environment's python. It runs from a copy of the repository's
    scripts whose python only records its arguments and whose Slurm scripts are stand-ins
    (the real ones start daemons, whether or not a cluster is up already): this checks
    which environment the scripts use, not the install itself."""
    repo = tmp_path / "repo"
    for script in (".ci/run", "scripts/venv.sh", "scripts/install.sh"):
        (repo / script).parent.mkdir(parents=True, exist_ok=True)
        (repo / script).write_text((REPO / script).read_text())
    for script in ("install.sh", "start.sh", "stop.sh"):
        (repo / "scripts" / "slurm").mkdir(exist_ok=True)
        (repo / "scripts" / "slurm" / script).write_text(f"echo stand-in slurm {script}\n")
    log = tmp_path / "calls.log"
    python = tmp_path / "elsewhere" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$*" >> "{log}"\n')
    python.chmod(0o755)
    result = subprocess.run(
        ["bash", str(repo / ".ci" / "run")],
        env={**os.environ, "VENV": "elsewhere"},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stand-in slurm install.sh" in result.stdout  # the copy's scripts ran
    calls = log.read_text().splitlines()
    assert any(c.startswith("-m pip") and "install" in c for c in calls), calls
    assert "-m pytest -q -n 2 --durations=15 tests" in calls, calls
    assert not (tmp_path / ".venv").exists() and not (repo / ".venv").exists()
