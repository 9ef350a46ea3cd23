"""Runs logged by wandb: offline run folders (``wandb/offline-run-*``) and the API.

wandb 0.2x+ writes an offline run as ``run-<id>.wandb``: a 7-byte header (``:W&B``, the
magic 0xBEE1, version 0) then LevelDB-log framed records (32 KiB blocks; each record a
7-byte header ``crc32 (zlib, seeded with the type byte) | length u16 | type u8`` where
type is FULL/FIRST/MIDDLE/LAST) whose payloads are ``wandb_internal_pb2.Record``
protobufs. Current wandb releases read these files only in their Go core, so the few
lines of framing are read here and the protobufs are parsed with wandb's own classes;
without the ``wandb`` package, offline folders are skipped with a message that says so.
"""

from __future__ import annotations

import json
import os
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

from cqk_megatron.run.folder import SUMMARY, TRAIN, VALID

HEADER = b":W&B"
FILE_HEADER_LEN = 7
RECORD_HEADER_LEN = 7
BLOCK_LEN = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4

# Metric names the training engine (or other loggers) may use, by what they mean.
TRAIN_LOSS_KEYS = ("train/loss", "loss", "train_loss", "train/lm_loss", "lm loss")
VALID_LOSS_KEYS = ("valid/loss", "val_loss", "valid/val_loss", "val/loss", "validation/loss")
TOKEN_KEYS = ("tokens", "train/tokens", "consumed_tokens", "valid/tokens", "val/tokens")
STEP_KEYS = ("step", "train/step", "iteration", "_step")
LR_KEYS = ("lr", "train/lr", "learning_rate")
SUMMARY_KEYS = ("params_total", "params_non_embedding", "flops_per_token")


class WandbUnavailable(RuntimeError):
    """The ``wandb`` package is not installed (offline folders need its protobufs)."""


def is_offline_run_dir(path: Path) -> bool:
    return path.is_dir() and any(path.glob("run-*.wandb"))


def _records(path: Path) -> Iterator[tuple[bytes | None, str | None]]:
    """Yield ``(payload, None)`` per record, or ``(None, problem)`` once at a bad tail."""
    data = path.read_bytes()
    if data[:4] != HEADER:
        yield None, f"{path}: not a wandb transaction log (no ':W&B' header)"
        return
    position, pending = FILE_HEADER_LEN, b""
    while position + RECORD_HEADER_LEN <= len(data):
        left_in_block = BLOCK_LEN - position % BLOCK_LEN
        if left_in_block < RECORD_HEADER_LEN:  # block trailer padding
            position += left_in_block
            continue
        checksum, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:  # zero padding at the end of a block
            position += left_in_block
            continue
        payload = data[position + 7 : position + 7 + length]
        if len(payload) < length or zlib.crc32(payload, zlib.crc32(bytes([kind]))) != checksum:
            yield None, f"{path}: truncated or corrupt record at byte {position}; rest ignored"
            return
        position += RECORD_HEADER_LEN + length
        if kind == FULL:
            yield payload, None
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload, None
            pending = b""


def _item_key(item) -> str:
    return "/".join(item.nested_key) if item.nested_key else item.key


def _first(values: dict, keys: tuple[str, ...]):
    for key in keys:
        if key in values and values[key] is not None:
            return values[key]
    return None


def read_offline_run(path: Path) -> dict:
    """The contents of one offline run folder as plain data.

    Returns ``{"name", "config" (nested dict), "history" (list of dicts), "summary",
    "finished" (bool), "problems" (list of str)}``.
    """
    try:
        from wandb.proto import wandb_internal_pb2
    except ImportError as error:
        raise WandbUnavailable(
            f"{path}: reading wandb offline runs needs the 'wandb' package "
            "(pip install wandb); skipped"
        ) from error
    logs = sorted(path.glob("run-*.wandb"))
    if not logs:
        raise FileNotFoundError(f"{path}: no run-*.wandb file in this offline run folder")
    run = {
        "name": path.name,
        "config": {},
        "history": [],
        "summary": {},
        "finished": False,
        "problems": [],
    }
    for payload, problem in _records(logs[-1]):
        if problem:
            run["problems"].append(problem)
            continue
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["name"] = record.run.display_name or run["name"]
            for item in record.run.config.update:
                run["config"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run["config"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            row = {_item_key(item): json.loads(item.value_json) for item in record.history.item}
            if record.history.HasField("step"):
                row.setdefault("_step", record.history.step.num)
            run["history"].append(row)
        elif kind == "summary":
            for item in record.summary.update:
                run["summary"][_item_key(item)] = json.loads(item.value_json)
        elif kind == "exit":
            run["finished"] = record.exit.exit_code == 0
    run["config"] = {k: v for k, v in run["config"].items() if not k.startswith("_")}
    return run


def history_to_metrics(history: list[dict]) -> list[dict]:
    """Map wandb history rows onto the JSONL metrics schema (train and valid lines).

    wandb merges everything logged at one step into one row, so a row may give both a
    training and a validation line.
    """
    lines = []
    for row in history:
        step = _first(row, STEP_KEYS)
        tokens = _first(row, TOKEN_KEYS)
        train_loss = _first(row, TRAIN_LOSS_KEYS)
        valid_loss = _first(row, VALID_LOSS_KEYS)
        base = {"step": step, "tokens": tokens, "time": row.get("_timestamp")}
        if train_loss is not None:
            lines.append({**base, "kind": TRAIN, "loss": train_loss, "lr": _first(row, LR_KEYS)})
        if valid_loss is not None:
            lines.append({**base, "kind": VALID, "val_loss": valid_loss})
    return lines


def summary_line(summary: dict, config: dict) -> dict | None:
    """A JSONL-style summary line from the run summary (or config), if it has the counts."""
    values = {key: _first(summary, (key, f"summary/{key}")) for key in SUMMARY_KEYS}
    for key in SUMMARY_KEYS:
        if values[key] is None:
            values[key] = config.get(key)
    if values["params_total"] is None:
        return None
    return {"kind": SUMMARY, **values}


def api_available() -> bool:
    """The API path needs a key (and the network, which the call itself will tell)."""
    return bool(os.environ.get("WANDB_API_KEY"))


def read_api_runs(project: str) -> list[dict]:
    """Runs of ``entity/project`` through the public API, in ``read_offline_run``'s shape.

    Needs ``WANDB_API_KEY`` and network access; never used in tests.
    """
    try:
        import wandb
    except ImportError as error:
        raise WandbUnavailable(
            "reading runs from the wandb API needs 'pip install wandb'"
        ) from error
    if not api_available():
        raise WandbUnavailable("reading runs from the wandb API needs WANDB_API_KEY to be set")
    runs = []
    for api_run in wandb.Api().runs(project):
        runs.append(
            {
                "name": api_run.name,
                "config": {k: v for k, v in dict(api_run.config).items() if not k.startswith("_")},
                "history": list(api_run.scan_history()),
                "summary": dict(api_run.summary),
                "finished": api_run.state == "finished",
                "problems": [],
                "path": f"wandb:{project}/{api_run.id}",
            }
        )
    return runs
