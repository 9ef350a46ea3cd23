"""The command-line layer: the parsers and ``main`` functions of the ``cqk`` commands.

``cqk_megatron/__main__.py`` dispatches ``cqk <command>`` to these modules (and to the few
commands whose parser lives with its program: ``cqk_megatron.train``, the module torchrun
and srun start; ``launch.submit``; ``data_tools``). Each module imports only what its parser
needs at the top (``--help`` returns at once, without torch or Megatron); the heavy
imports come inside the functions that run the command.
"""
