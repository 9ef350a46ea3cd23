import sys

from cqk_megatron.cli.analyze import main

sys.exit(main())
