"""Continuous batching: the step plan, block arithmetic and the scheduling policy. Torch-free."""
