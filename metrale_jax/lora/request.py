"""`LoRARequest`: which adapter a request runs under, as vLLM's offline API names it."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """An adapter by name, the user's integer id for it, and its PEFT directory (vLLM's
    positional order). The name is what the engine keys on; the same name must always
    come with the same id and path while it is registered."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: expected a non-empty string, got {self.lora_name!r}")
        if type(self.lora_int_id) is not int or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1 (0 is the base model), "
                             f"got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: expected a non-empty string, got {self.lora_path!r}")

    # vLLM's short aliases
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
