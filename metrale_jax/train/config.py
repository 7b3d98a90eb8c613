"""What a training run is: the model, the corpus, the optimiser and the loop's schedule."""

from __future__ import annotations

import dataclasses

from metrale_jax.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    # Batch geometry: batch_size rows of seq_len tokens per step.
    batch_size: int = 16
    seq_len: int = 256
    steps: int = 1100
    # AdamW with linear warm-up, then cosine decay to min_lr_ratio * lr.
    lr: float = 2e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global gradient norm
    # DeepSeek-V3's lambda: the MTP losses add mtp_weight / depths each.
    mtp_weight: float = 0.3
    seed: int = 0           # model init and data order
    eval_every: int = 100   # steps between validation losses
    eval_batches: int = 4   # validation batches per interval (the final evaluation uses all)
    checkpoint_every: int = 50
    block_size: int = 16    # KV page size of the training step

    def __post_init__(self) -> None:
        for name in ("batch_size", "seq_len", "steps", "eval_every", "checkpoint_every",
                     "block_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: must be >= 0, got {self.warmup_steps}")

    def window(self, model: ModelConfig) -> int:
        """Tokens per example: inputs, next-token targets, one more per MTP depth."""
        return self.seq_len + 1 + model.num_mtp_modules
