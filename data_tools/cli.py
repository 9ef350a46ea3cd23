"""What every command shares: clear one-line errors instead of tracebacks."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

from cqk_megatron.config import ConfigError
from cqk_megatron.data.errors import DataError


def friendly_errors(main: Callable[..., int]) -> Callable[..., int]:
    """Print ``DataError``/``ConfigError`` as ``error: ...`` and exit with status 2."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs)
        except (DataError, ConfigError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("interrupted; nothing half-written was kept", file=sys.stderr)
            return 130

    return wrapper
