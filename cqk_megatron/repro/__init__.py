"""One command that reproduces the paper's attention comparison: ``python -m
cqk_megatron.repro --preset {paper-60m,paper-150m,cpu-tiny}`` (see ``cli``)."""
