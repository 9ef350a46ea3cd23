"""Rank 0's record of a run: a JSONL file the analysis reads, wandb, TensorBoard, and a
progress bar on terminals (plain lines in logs).

JSONL lines: ``{"kind": "train", step, tokens, loss, lr, grad_norm, tokens_per_s,
step_time_s, tflops (per device), mfu (None without a peak: ``log.peak_tflops`` or a known
GPU), mem_gb (GiB), mem_kind (``gpu_peak_allocated`` | ``max_rss``: what mem_gb is),
skipped, time}``, ``{"kind": "valid", step, tokens,
val_loss, val_ppl, time[, final]}`` and, when a run finishes, ``{"kind": "summary", ...}``.

One record per step and kind: a run that starts at step S (a resume, or ``--resume none``
at 0) first rewrites the file (atomically) without the records past S that an earlier
attempt logged after its last checkpoint, and without its summary; a ``final`` flag at
S is dropped unless this attempt is the final one. ``run_folder.read_metrics`` is the one reader
(status, analysis, repro): it applies the same rule to files written before it, or
interleaved by two writers. The record kinds and that reader are the run contract's
(``cqk_megatron.run.folder``); this module is their one writer.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from cqk_megatron.config import RunConfig, to_dict
from cqk_megatron.run.atomic import append_line, write_text_atomically
from cqk_megatron.run.folder import (
    METRICS,
    TRAIN,
    VALID,
    read_metrics,
    records_up_to,
    wandb_run_id,
)
from cqk_megatron.run.unwritable import no_space_error


def wandb_credentials_found() -> bool:
    """Whether wandb would find credentials without asking: its own lookup, in its order
    (``WANDB_API_KEY`` or ``WANDB_IDENTITY_TOKEN_FILE``, then ``~/.netrc`` or ``$NETRC``
    as ``wandb login`` writes it, then its settings' ``api_key``). Offline: no network."""
    try:  # wandb's lookup without its network call (wandb.login prints the user's name)
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
        from wandb.sdk.lib.wbauth import authenticate

        settings = wandb_setup.singleton().settings
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        found = authenticate._use_system_auth(host=host, source="cqk", update_session=False)
        return found is not None
    except (ImportError, AttributeError, TypeError):  # another wandb: its public lookup
        import wandb

        return wandb.login(prompt=False, verify=False)


def wandb_mode(requested: str, run_dir: Path) -> str:
    """``log.wandb_mode``, or ``offline`` (said once, here) when ``online`` finds no
    credentials: the run is kept on disk for ``wandb sync``."""
    if requested != "online":
        return requested
    try:
        if wandb_credentials_found():
            return "online"
        why = "no W&B API key found (WANDB_API_KEY, or ~/.netrc as `wandb login` writes it)"
    except Exception as error:  # a malformed key or token file: wandb's message says which
        why = f"wandb refused its credentials ({error})"
    print(
        f"warning: log.wandb_mode=online but {why}: logging offline to {run_dir}/wandb; "
        f"upload it later with `wandb sync {run_dir}/wandb/offline-run-*`",
        file=sys.stderr,
        flush=True,
    )
    return "offline"


# What a train record's mem_gb measures: the GPU's peak allocated memory (torch's
# max_memory_allocated), or on CPU the process's peak resident set (ru_maxrss).
GPU_PEAK_ALLOCATED, MAX_RSS = "gpu_peak_allocated", "max_rss"


def train_line(record: dict, total: int | None = None, eta_s: float | None = None) -> str:
    """The console line of a train record: the step (of ``total``), loss, learning rate and
    gradient norm, then throughput, MFU and memory as torchtitan shows them (n/a where the
    record has none), and with ``total`` the time left (``eta_s``; n/a before it is known)."""
    mfu, memory = record.get("mfu"), record.get("mem_gb")
    label = "max RSS" if record.get("mem_kind") == MAX_RSS else "mem"
    step = (
        f"{record['step']:>6}" if total is None else f"{record['step']:>{len(str(total))}}/{total}"
    )
    line = (
        f"step {step} | loss {record['loss']:.4f} | lr {record['lr']:.2e}"
        f" | grad {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s"
        f" | MFU {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}"
        f" | {label} {'n/a' if memory is None else f'{memory:.2f} GiB'}"
    )
    if total is None:
        return line
    return f"{line} | ETA {'n/a' if eta_s is None else duration(eta_s)}"


def duration(seconds: float) -> str:
    """``42s``, ``3m07s``, ``5h04m``: seconds to the unit a reader wants."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class StepClock:
    """The time left to ``total`` steps, at the pace since the first step this process
    logged (so neither start-up nor the steps of an earlier attempt count)."""

    def __init__(self) -> None:
        self._first: tuple[int, float] | None = None

    def seconds_left(self, step: int, total: int, now: float) -> float | None:
        if self._first is None:
            self._first = (step, now)
            return None
        first_step, first_time = self._first
        if step <= first_step:
            return None
        return (now - first_time) / (step - first_step) * max(0, total - step)


class MetricsLogger:
    def __init__(self, run_dir: Path, config: RunConfig, enabled: bool) -> None:
        self.enabled = enabled
        self.config = config
        self.path = run_dir / METRICS
        self._wandb = None
        self._tensorboard = None
        self._bar = None
        self._clock = StepClock()
        if not enabled:
            return
        try:  # the file exists (and can be written) from the start
            self.path.touch()
        except OSError as error:
            raise no_space_error(self.path, error) from error
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
        # The id is the run folder's (run_folder.WANDB_ID): a requeue or resume of this
        # run logs to its wandb run; a run of the same name elsewhere gets its own.
        return wandb.init(
            project=config.log.wandb_project,
            name=config.name,
            id=wandb_run_id(run_dir),
            resume="allow",
            dir=str(run_dir),
            mode=wandb_mode(config.log.wandb_mode, run_dir),
            config=to_dict(config),
            tags=list(config.log.tags) + [config.attention.variant],
        )

    def set_start(self, step: int, final: bool = False) -> None:
        """This attempt starts at ``step`` (``final``: it only evaluates and finishes):
        the file loses what an earlier attempt logged past ``step``, atomically."""
        if self.enabled:
            self._rewrite_from(step, final)
        if self._bar is not None:
            self._bar.n = step
            self._bar.refresh()

    def _rewrite_from(self, step: int, final: bool) -> None:
        found = read_metrics(self.path)
        kept = [dict(r) for r in records_up_to(found.records, step)]
        for record in kept:
            if record.get("final") and record.get("step") == step and not final:
                record.pop("final")  # the run goes on past it
        kept = [r for r in kept if not (final and r.get("final") and r.get("step") == step)]
        if kept == found.records and not found.superseded and not found.problems:
            return
        text = "".join(json.dumps(r) + "\n" for r in kept)
        try:
            write_text_atomically(self.path, text)
        except OSError as error:
            raise no_space_error(self.path, error) from error

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, "time": time.time()}
        self._append(json.dumps(record))
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
        if record["kind"] == TRAIN:
            total = self.config.train.train_steps
            eta = self._clock.seconds_left(record["step"], total, record["time"])
            text = train_line(record, total, eta)
            if self._bar is not None:
                self._bar.n = record["step"]
                self._bar.set_postfix(
                    loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}"
                )
                return
        elif record["kind"] == VALID:
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

    def _append(self, line: str) -> None:
        """One record: a whole line or none (a full disk leaves the file's last line
        whole), and a filesystem that refuses it as ``NoSpaceError`` naming it."""
        try:
            append_line(self.path, line)
        except OSError as error:
            raise no_space_error(self.path, error) from error
