"""The speculative-decoding settings: one validated object, shaped like vLLM's
`speculative_config` (`{"method": "mtp", "num_speculative_tokens": k}`), plus our `gate`."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from metrale_jax.spec.gate import GATE_POLICIES

METHODS = ("mtp",)


class SpeculativeConfigError(ValueError):
    """An invalid speculative_config; the message names the key."""


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "mtp"             # drafts from the model's own MTP modules
    num_speculative_tokens: int = 2  # k: drafts per sequence per step (<= the model's modules)
    gate: str = "auto"              # auto: speculate where it pays; on / off: fixed

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise SpeculativeConfigError(
                f"speculative_config.method: must be one of {METHODS}, got {self.method!r}")
        k = self.num_speculative_tokens
        if type(k) is not int or k < 1:
            raise SpeculativeConfigError("speculative_config.num_speculative_tokens: must be "
                                         f"a positive integer, got {k!r}")
        if self.gate not in GATE_POLICIES:
            raise SpeculativeConfigError(
                f"speculative_config.gate: must be one of {GATE_POLICIES}, got {self.gate!r}")

    @classmethod
    def parse(cls, value: Any) -> "SpeculativeConfig | None":
        """From what a user passes: None, a SpeculativeConfig, a dict or its JSON text."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise SpeculativeConfigError(f"speculative_config: not valid JSON ({err})") \
                    from None
            if value is None:
                return None
        if not isinstance(value, Mapping):
            raise SpeculativeConfigError("speculative_config: expected an object like "
                                         '{"method": "mtp", "num_speculative_tokens": 2}, '
                                         f"got {type(value).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"speculative_config: unknown keys {unknown}; the "
                                         f"keys are {sorted(known)}")
        return cls(**value)

    def check_model(self, num_mtp_modules: int, model_name: str) -> None:
        """Speculation asked of a model that cannot draft is an error, never a silent off."""
        if num_mtp_modules == 0:
            raise SpeculativeConfigError(
                f"speculative_config: method 'mtp' needs MTP modules, and {model_name} has "
                "none (no mtp.* / next-n weights); drop speculative_config to decode plainly")
        if self.num_speculative_tokens > num_mtp_modules:
            raise SpeculativeConfigError(
                "speculative_config.num_speculative_tokens: "
                f"{self.num_speculative_tokens} drafts need as many MTP modules; {model_name} "
                f"has {num_mtp_modules}")
