"""The training loop's callbacks (``base.Callback``); ``training/loop.callbacks_in_order``
lists them in the order their hooks run, and docs/training.md explains that order."""
