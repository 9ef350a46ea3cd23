"""Reading a run config: YAML files, ``include:`` and ``key.sub=value`` overrides.

A file may start with ``include: [other.yaml, ...]`` (paths relative to the file, then to
``configs/``); later entries and the file's own keys win. ``key.sub=value`` overrides apply
last, values parsed as YAML. Torch-free.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cqk_megatron.config.duplicates import refuse_duplicate_keys
from cqk_megatron.config.schema import (
    CONFIGS_DIR,
    MODEL_FAMILIES,
    ConfigError,
    RunConfig,
    flatten,
    from_dict,
    renamed_path,
    renamed_tree,
    to_dict,
)
from cqk_megatron.variants import VARIANTS

COMMAND_LINE = "command line"  # the overrides a user typed (``load_config_traced``'s label)

# ---------------------------------------------------------------------------------------
# YAML files, includes and overrides
# ---------------------------------------------------------------------------------------


def _deep_merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in update.items():
        if value is None and isinstance(merged.get(key), dict):
            continue  # "model:" with everything commented out keeps what was included
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def variant_preset(path: str | Path) -> dict[str, Any] | None:
    """``variants/<preset>.yaml`` (any folder named ``variants``, the file absent) as the
    registry's preset: its ``attention.coupling`` and ``attention.scoring``. The presets
    live in the registry only (``variants/builtin.py``, or registered from code), so that
    no YAML copy of them can drift; a real file of that name wins."""
    path = Path(path)
    if path.parent.name != "variants" or path.suffix != ".yaml" or path.is_file():
        return None
    if path.stem not in VARIANTS:
        return None
    coupling, scoring = VARIANTS[path.stem]
    return {"attention": {"coupling": coupling, "scoring": scoring}}


def _resolve_include(name: str, relative_to: Path) -> Path:
    for candidate in (relative_to / name, CONFIGS_DIR / name):
        if candidate.is_file() or variant_preset(candidate) is not None:
            return candidate
    raise ConfigError(
        f"{relative_to}: included file '{name}' not found next to it or under {CONFIGS_DIR}"
        f" (variants/NAME.yaml names a registered preset: one of {list(VARIANTS)})"
    )


def read_yaml(path: str | Path, what: str = "config file", fix: str = "") -> dict[str, Any]:
    """The top-level mapping of one YAML file: the one reader of run configs, sweeps and
    cluster profiles, with one error format (the file, what is wrong, the fix); the
    caller types the mapping with ``from_dict``, whose errors name the key."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} '{path}' does not exist" + (f" ({fix})" if fix else ""))
    text = path.read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from error
    refuse_duplicate_keys(path, text)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping of keys")
    return data


def load_yaml_dict(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a config file with its includes resolved into one nested dict."""
    path = Path(path)
    preset = variant_preset(path)
    if preset is not None:
        return preset
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: include cycle through {[str(p) for p in _seen]}")
    data = renamed_tree(RunConfig, read_yaml(path), str(path))  # before includes merge in
    includes = data.pop("include", []) or []
    if isinstance(includes, str):
        includes = [includes]
    merged: dict[str, Any] = {}
    for name in includes:
        included = _resolve_include(name, path.parent)
        merged = _deep_merge(merged, load_yaml_dict(included, _seen + (path.resolve(),)))
    return _deep_merge(merged, data)


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b=c`` overrides (``c`` parsed as YAML) to a nested dict."""
    data = _deep_merge({}, data)
    for override in overrides:
        if "=" not in override:
            raise ConfigError(f"override '{override}' must look like section.key=value")
        dotted, raw = override.split("=", 1)
        # an old name sets the new one, so that a file's new name loses
        keys = renamed_path(dotted.strip().split("."), f"override {override!r}")
        node = data
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override '{override}': '{key}' is not a section")
        node[keys[-1]] = _override_value(override, raw)
    return data


def _override_path(override: str) -> tuple[str, ...] | None:
    """The keys ``key.sub=value`` sets, old names as their new ones (None: not an override,
    which ``apply_overrides`` refuses)."""
    if "=" not in override:
        return None
    keys = override.split("=", 1)[0].strip().split(".")
    return tuple(renamed_path(keys, override, warn=False))


_Given = tuple[tuple[str, ...], int, str]  # an override's keys, its position, its text


def refuse_repeated_overrides(overrides: Sequence[str], where: str = COMMAND_LINE) -> None:
    """Raise ``ConfigError`` when two of ``overrides`` set one key (``train.optimizer.lr=1``,
    then ``train.optimizer.lr=2``; or an old and a new name of one key, ``train.lr=1`` and
    ``train.optimizer.lr=2``), or one sets a section that holds the other's key
    (``train={...}`` and ``train.optimizer.lr=2``), naming the key and both arguments.
    Applied in order, the later would silently replace the earlier, as a duplicate YAML key
    would (``config.duplicates``)."""
    seen: list[_Given] = []
    for position, override in enumerate(overrides, 1):
        keys = _override_path(override)
        if keys is None:
            continue
        given = (keys, position, override)
        for earlier in seen:
            common = min(len(keys), len(earlier[0]))
            if keys[:common] == earlier[0][:common]:
                raise ConfigError(_repeat_message(where, earlier, given))
        seen.append(given)


def _repeat_message(where: str, earlier: _Given, later: _Given) -> str:
    longer, shorter = sorted((earlier[0], later[0]), key=len, reverse=True)
    key = ".".join(longer)
    held = "" if longer == shorter else f" (the section '{'.'.join(shorter)}' holds it)"
    return (
        f"{where}: key '{key}' is given twice{held}, by override {earlier[1]} {earlier[2]!r} "
        f"and override {later[1]} {later[2]!r}; the later would silently replace the "
        "earlier: give each key once"
    )


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


def apply_model_family(data: dict[str, Any]) -> dict[str, Any]:
    """Fill in the architecture fields of ``model.family`` that ``data`` leaves unset."""
    model = data.get("model")
    family = model.get("family") if isinstance(model, dict) else None
    if family not in MODEL_FAMILIES:
        return data  # None, or unknown: validate() names it
    return _deep_merge(data, {"model": {**MODEL_FAMILIES[family], **(model or {})}})


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


# ---------------------------------------------------------------------------------------
# where each value came from (--print-config)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TracedConfig:
    """A loaded config and, for each dotted key set anywhere, where its value was set last
    (a file, a cluster profile, the command line); a key absent from ``sources`` has its
    default."""

    config: RunConfig
    sources: dict[str, str]


def _file_sources(path: Path) -> dict[str, str]:
    """Which file of ``path``'s include tree sets each key, as ``load_yaml_dict`` merges
    them (its includes in order, then its own keys). Reads files ``load_yaml_dict`` has
    already checked (YAML, mappings, no include cycle). A ``variants/NAME.yaml`` that is
    the registry's preset sets its keys as that preset."""
    preset = variant_preset(path)
    if preset is not None:
        return dict.fromkeys(flatten(preset), f"variant preset {path.stem} (the registry)")
    data = yaml.safe_load(path.read_text()) or {}
    includes = data.pop("include", []) or []
    sources: dict[str, str] = {}
    for name in [includes] if isinstance(includes, str) else includes:
        included = _resolve_include(name, path.parent)
        sources.update(_file_sources(included))
    sources.update(dict.fromkeys(map(_current_name, flatten(data)), os.path.normpath(path)))
    return sources


def _current_name(dotted: str) -> str:
    """``dotted`` under its name today (``train.lr`` -> ``train.optimizer.lr``): a key is
    traced to where it is set, whichever name set it (the loading has warned already)."""
    return ".".join(renamed_path(dotted.split("."), dotted, warn=False))


def _override_keys(overrides: Sequence[str]) -> Iterator[str]:
    for override in overrides:
        dotted, raw = override.split("=", 1)  # load_config has refused any other form
        value = _override_value(override, raw)
        if isinstance(value, dict):
            yield from map(_current_name, flatten(value, f"{dotted.strip()}."))
        else:
            yield _current_name(dotted.strip())


def load_config_traced(
    path: str | Path | None = None, overrides: Sequence[tuple[str, Sequence[str]]] = ()
) -> TracedConfig:
    """``load_config(path, every override)``, and where each value came from.

    ``overrides`` are groups ``(where, ["key=value", ...])``, applied in order (a later
    group wins), e.g. ``[("cluster profile p.yaml", [...]), (COMMAND_LINE, argv)]``.
    """
    for where, group in overrides:
        if where == COMMAND_LINE:  # what a user typed; a sweep's or a profile's are composed
            refuse_repeated_overrides(group)
    config = load_config(path, [o for _, group in overrides for o in group])
    sources = _file_sources(Path(path)) if path is not None else {}
    for where, group in overrides:
        sources.update(dict.fromkeys(_override_keys(group), where))
    family = config.model.family
    if family in MODEL_FAMILIES:  # the family's fields that nothing set explicitly
        origin = f"by model.family={family} ({sources.get('model.family', 'default')})"
        for key in MODEL_FAMILIES[family]:
            sources.setdefault(f"model.{key}", origin)
    return TracedConfig(config, sources)


def _yaml_value(value: Any) -> str:
    """``value`` as one line of YAML that reads back as it."""
    text = yaml.safe_dump([value], default_flow_style=True, width=1 << 30).strip()
    return str(text)[1:-1]  # the list's brackets


def explain_config(traced: TracedConfig, title: str | None = None) -> str:
    """The config as YAML (``load_config`` reads it back as it is), each value that
    differs from the default followed by a comment saying where it was set and the
    default it replaces."""
    defaults = flatten(to_dict(RunConfig()))
    lines = [f"# {title}"] if title else []
    lines.append("# each value that is not the default says where it was set")

    def emit(data: dict[str, Any], prefix: str, indent: str) -> None:
        for key, value in data.items():
            dotted = f"{prefix}{key}"
            if isinstance(value, dict):
                lines.append(f"{indent}{key}:")
                emit(value, f"{dotted}.", indent + "  ")
                continue
            line = f"{indent}{key}: {_yaml_value(value)}"
            if value != defaults.get(dotted):
                where = traced.sources.get(dotted, "derived")
                line += f"  # {where}; default {_yaml_value(defaults.get(dotted))}"
            lines.append(line)

    emit(to_dict(traced.config), "", "")
    return "\n".join(lines) + "\n"
