"""Sampling: `Sampler` turns a step's logits into token ids (see `sampler.py`)."""

from __future__ import annotations

from pagedinfer.sample.metadata import LogprobsTensors, SamplerOutput, SamplingMetadata
from pagedinfer.sample.sampler import Sampler

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata"]
