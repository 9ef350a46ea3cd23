"""The README's demo, shortened (6 steps per run, same path through every stage), from the
installed environment: every artefact exists and is valid, and a second run skips what is
done."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_demo(out: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "DEMO_OUT": str(out),
        "DEMO_STEPS": "6",
        "DEMO_SKIP_INSTALL": "1",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )


def test_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = run_demo(out)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for variant in ("standard", "coupled"):
        run = out / "runs" / f"demo-{variant}"
        lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines if r["kind"] == "train"] == list(range(1, 7))
        assert any(r.get("final") for r in lines) and lines[-1]["kind"] == "summary"
        assert (run / "checkpoints" / "latest").read_text().strip() == "iter_0000006"
        assert list((run / "wandb").glob("offline-run-*"))
    # the Hugging Face folder loads and generates in a fresh process, with no network
    hf = out / "hf" / "demo-coupled"
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
    report = (out / "report" / "report.md").read_text()
    assert "| demo-coupled | coupled |" in report and "| demo-standard | standard |" in report
    assert "step time / standard" in report
    assert "![loss curves](figures/loss_curves.png)" in report
    png = out / "report" / "figures" / "loss_curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Done. Where everything is" in result.stdout
    # trained as jobs of the launcher: its job records and per-task logs are in the run
    events = (out / "runs" / "demo-coupled" / "jobs.jsonl").read_text()
    assert '"event": "started"' in events and '"event": "finished"' in events
    assert list((out / "runs" / "demo-coupled" / "submitit").glob("*_1_log.out"))

    again = run_demo(out)  # finished stages are skipped, nothing is retrained
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "demo-standard: already trained" in again.stdout
    assert "demo-coupled: already trained" in again.stdout
