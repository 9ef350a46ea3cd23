"""The old name of ``cqk analyze``; the command line lives in ``cqk_megatron.cli.analyze``."""

import sys

from cqk_megatron.cli.analyze import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
