import sys

from cqk_megatron.cli.repro import main

sys.exit(main())
