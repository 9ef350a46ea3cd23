"""Train the tiny config in this process on the synthetic data (a real subprocess for the
signal test). Usage: python _train_script.py ROOT NAME [overrides...]"""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

from _training import config_for, synthetic_datasets  # noqa: E402

if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from cqk_megatron.training.loop import train

    config = config_for(sys.argv[1], sys.argv[2], sys.argv[3:])
    sys.exit(train(config, datasets=synthetic_datasets(config)))
