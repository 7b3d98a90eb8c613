"""Free lists for KV blocks and SSM slots (host only, no jax).

Block 0 and slot 0 are the null entries padding points at; they are never handed out.
"""

from __future__ import annotations


class OutOfBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # Pop from the end so low block ids are handed out first (easier to read in tests).
        self._free = list(range(num_blocks - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free")
        taken = self._free[len(self._free) - n:][::-1]
        del self._free[len(self._free) - n:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


class SlotPool:
    """SSM state slots, one per running sequence of a model with Mamba2 layers."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfBlocks("no free SSM slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)
