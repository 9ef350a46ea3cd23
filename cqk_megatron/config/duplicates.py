"""Keys given twice in one YAML file, at any depth.

PyYAML keeps the last of two equal keys without a word, so a file with ``train:`` twice
loses the first section whole. Such a file is refused, naming the key and both lines,
rather than one of them silently winning. Torch-free.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from cqk_megatron.config.schema import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"  # "<<: *anchor" may repeat keys it merges in


def refuse_duplicate_keys(path: Path, text: str) -> None:
    """Raise ``ConfigError`` for the first key that one mapping of ``text`` holds twice,
    naming ``path``, the dotted key and both lines. ``text`` is valid YAML."""
    root = yaml.compose(text, Loader=yaml.SafeLoader)
    for dotted, first, second in _duplicates(root, "", set()):
        raise ConfigError(
            f"{path}: key '{dotted}' is given twice (lines {first} and {second}); YAML "
            "would keep only the second, silently dropping the first: merge them into one"
        )


def _duplicates(
    node: yaml.Node | None, prefix: str, seen: set[int]
) -> Iterator[tuple[str, int, int]]:
    """(dotted key, first line, second line) for each repeated key under ``node``."""
    if node is None or id(node) in seen:  # an alias is walked once
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield from _duplicates(item, f"{prefix}{index}.", seen)
    if not isinstance(node, yaml.MappingNode):
        return
    lines: dict[str, int] = {}
    for key_node, value_node in node.value:
        if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
            continue
        line = key_node.start_mark.line + 1
        dotted = f"{prefix}{key_node.value}"
        if key_node.value in lines:
            yield dotted, lines[key_node.value], line
        lines.setdefault(key_node.value, line)
        yield from _duplicates(value_node, f"{dotted}.", seen)
