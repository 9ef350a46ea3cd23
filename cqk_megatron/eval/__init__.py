"""Evaluations beyond the training loss: synthetic recall (MQAR)."""
