import sys

from cqk_megatron.repro.cli import main

sys.exit(main())
