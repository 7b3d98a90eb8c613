"""Multi-LoRA serving (DESIGN "LoRA").

Host side: `registry` (names, ids, PEFT paths, which adapter holds which device slot) and
`request` (`LoRARequest`); the runner owns the device slots (`runner/lora_slots.py`), and the
row contract carries each row's slot id (`ScheduledRow.adapter_slot`). `weights` is the
hand-off between the two: an adapter read from a PEFT directory, as host arrays.
"""

from metrale_jax.lora.config import LoraConfig
from metrale_jax.lora.request import LoRARequest
from metrale_jax.lora.weights import LoraError, LoraWeights

__all__ = ["LoRARequest", "LoraConfig", "LoraError", "LoraWeights"]
