"""Speculative decoding: proposers, the rejection sampler and their metrics."""
