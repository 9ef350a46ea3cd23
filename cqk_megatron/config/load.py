"""Reading a run config: YAML files, ``include:`` and ``key.sub=value`` overrides.

A file may start with ``include: [other.yaml, ...]`` (paths relative to the file, then to
``configs/``); later entries and the file's own keys win. ``key.sub=value`` overrides apply
last, values parsed as YAML. Torch-free.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from cqk_megatron.config.schema import (
    CONFIGS_DIR,
    MODEL_FAMILIES,
    ConfigError,
    RunConfig,
    from_dict,
    to_dict,
)

# The couplings, scorings and named variants (presets of the two) are the registry's, as
# live views: a coupling registered later (README, "Adding a variant") is in them too. The
# registry is torch-free, like this module.

# ---------------------------------------------------------------------------------------
# YAML files, includes and overrides
# ---------------------------------------------------------------------------------------


def _deep_merge(base: dict, update: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if value is None and isinstance(merged.get(key), dict):
            continue  # "model:" with everything commented out keeps what was included
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _resolve_include(name: str, relative_to: Path) -> Path:
    for candidate in (relative_to / name, CONFIGS_DIR / name):
        if candidate.is_file():
            return candidate
    raise ConfigError(
        f"{relative_to}: included file '{name}' not found next to it or under {CONFIGS_DIR}"
    )


def load_yaml_dict(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a config file with its includes resolved into one nested dict."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file '{path}' does not exist")
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: include cycle through {[str(p) for p in _seen]}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict = {}
    for name in includes:
        included = _resolve_include(name, path.parent)
        merged = _deep_merge(merged, load_yaml_dict(included, _seen + (path.resolve(),)))
    return _deep_merge(merged, data)


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``a.b=c`` overrides (``c`` parsed as YAML) to a nested dict."""
    data = _deep_merge({}, data)
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override '{override}' must look like section.key=value")
        dotted, raw = override.split("=", 1)
        keys = dotted.strip().split(".")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{override}': '{key}' is not a section")
        node[keys[-1]] = _override_value(override, raw)
    return data


def _override_value(override: str, raw: str) -> Any:
    """The value of ``key=raw`` as YAML reads it (empty: null)."""
    if not raw.strip():
        return None
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as error:
        problem = str(error).splitlines()[0]
        raise ConfigError(
            f"override {override!r}: the value is not valid YAML ({problem}); quote it, "
            "e.g. key='value'"
        ) from error


def apply_model_family(data: dict) -> dict:
    """Fill in the architecture fields of ``model.family`` that ``data`` leaves unset."""
    model = data.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    if family not in MODEL_FAMILIES:
        return data  # None, or unknown: validate() names it
    return _deep_merge(data, {"model": {**MODEL_FAMILIES[family], **model}})


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults) and apply overrides; does not validate."""
    data = load_yaml_dict(path) if path is not None else {}
    data = apply_model_family(apply_overrides(data, overrides or []))
    source = str(path) if path is not None else "defaults"
    if overrides:
        source += " + overrides"
    return from_dict(RunConfig, data, source)


def save_config(config: RunConfig, path: str | Path) -> None:
    """Write the resolved config; ``load_config`` of the file gives it back."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))
