"""One adapter as host arrays: what the registry reads from a PEFT directory (off the engine
thread) and the runner copies into a device slot at a quiescent tick."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import numpy as np


class LoraError(ValueError):
    """An adapter cannot be used: unsupported format or target, rank too large, unknown
    name. The message says which adapter and why."""


@dataclasses.dataclass(frozen=True)
class LoraWeights:
    name: str
    rank: int                  # r, before padding to max_lora_rank
    scaling: float             # alpha / r, or alpha / sqrt(r) for rsLoRA
    # Per target projection, keyed by the projection's path in our model (the keys
    # `lora.targets.target_paths(model_config)` lists): (A [in, r], B [r, out]) as float32.
    # The projection's output gains x @ A @ B * scaling.
    targets: Mapping[str, tuple[np.ndarray, np.ndarray]]
