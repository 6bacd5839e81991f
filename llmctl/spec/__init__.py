"""Speculative decoding: n-gram prompt lookup or a draft model, verified in one batched forward
(see speculator.py for the step, rejection.py for the sampling)."""
