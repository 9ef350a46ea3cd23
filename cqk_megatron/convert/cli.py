"""The old name of ``cqk convert`` (``python -m cqk_megatron.convert.cli``); the command
line lives in ``cqk_megatron.cli.convert``."""

import sys

from cqk_megatron.cli.convert import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
