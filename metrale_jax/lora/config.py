"""The LoRA configuration: how many adapters fit on the device at once, and how large."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class LoraConfig:
    # Device slots for adapters (slot 0, "no adapter", comes on top): at most this many
    # distinct adapters run in one step, and the adapter-cohort gate holds the rest back.
    max_loras: int = 4
    # Every adapter's rank is padded to this; a larger rank is refused where it is loaded.
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras: must be >= 1, got {self.max_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")

    def replace(self, **changes) -> "LoraConfig":
        return dataclasses.replace(self, **changes)
