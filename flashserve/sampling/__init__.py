"""Picking tokens on the device: the per-request parameters, the sampler and its seeded noise."""
