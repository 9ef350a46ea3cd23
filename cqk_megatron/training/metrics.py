"""Rank 0's record of a run: a JSONL file the analysis reads, wandb, TensorBoard, and a
progress bar on terminals (plain lines in logs).

JSONL lines: ``{"kind": "train", step, tokens, loss, lr, grad_norm, tokens_per_s,
step_time_s, tflops (per device), mfu (None without a known GPU peak), mem_gb, skipped,
time}``, ``{"kind": "valid", step, tokens,
val_loss, val_ppl, time[, final]}`` and, when a run finishes, ``{"kind": "summary", ...}``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from cqk_megatron.config import RunConfig, to_dict


class MetricsLogger:
    def __init__(self, run_dir: Path, config: RunConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.config = config
        self.path = run_dir / "metrics.jsonl"
        self._wandb = None
        self._tensorboard = None
        self._bar = None
        if not enabled:
            return
        self._file = self.path.open("a")
        if config.log.wandb_mode != "disabled":
            self._wandb = self._start_wandb(run_dir, config)
        if config.log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(str(run_dir / "tensorboard"))
        show_bar = config.log.progress_bar == "on" or (
            config.log.progress_bar == "auto" and sys.stderr.isatty()
        )
        if show_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=config.train.train_steps, desc=config.name, unit="step")

    @staticmethod
    def _start_wandb(run_dir: Path, config: RunConfig):
        try:
            import wandb
        except ImportError:
            print("wandb is not installed: logging to metrics.jsonl only", file=sys.stderr)
            return None
        mode = config.log.wandb_mode
        if mode == "online" and not os.environ.get("WANDB_API_KEY"):
            mode = "offline"  # no key: keep the run on disk, `wandb sync` it later
        return wandb.init(
            project=config.log.wandb_project,
            name=config.name,
            id=config.name,
            resume="allow",
            dir=str(run_dir),
            mode=mode,
            config=to_dict(config),
            tags=list(config.log.tags) + [config.attention.variant],
        )

    def set_start(self, step: int) -> None:
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, "time": time.time()}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        numbers = {
            f"{record['kind']}/{k}": v
            for k, v in record.items()
            if isinstance(v, int | float)
            and not isinstance(v, bool)
            and k not in ("step", "time")
            and v is not None
            and math.isfinite(v)
        }
        if self._wandb is not None and "step" in record:
            self._wandb.log(numbers, step=record["step"])
        if self._tensorboard is not None and "step" in record:
            for key, value in numbers.items():
                self._tensorboard.add_scalar(key, value, record["step"])
        self._print(record)

    def _print(self, record: dict) -> None:
        if record["kind"] == "train":
            text = (
                f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e}"
                f" | grad {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s"
            )
            if self._bar is not None:
                self._bar.n = record["step"]
                self._bar.set_postfix(
                    loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}"
                )
                return
        elif record["kind"] == "valid":
            text = (
                f"step {record['step']:>6} | validation loss {record['val_loss']:.4f}"
                f" | perplexity {record['val_ppl']:.2f}"
                + (" (final)" if record.get("final") else "")
            )
        else:
            text = f"{record['kind']}: " + json.dumps(
                {k: v for k, v in record.items() if k != "kind"}
            )
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._tensorboard is not None:
            self._tensorboard.close()
        self._file.close()
