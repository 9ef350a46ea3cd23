"""The training engine: loop, DeepSpeed ZeRO engine over Megatron-Core model parallel,
checkpoints, learning-rate schedules, metrics and preemption handling."""
