"""The scheduler snapshot: what `/metrics` and the admin API read.

The engine thread publishes one in phase 4 of every tick (the seed's fields, with the seed's
names) and again before it blocks on an idle inbox, so readers on other threads never see
counts the engine has moved past. The fields after `published_at` are ours, not the seed's.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerSnapshot:
    active_seqs: int          # decoding
    prefilling_seqs: int
    swapped_seqs: int         # the seed's name for parked: swapped to disk plus preempted
    pending_len: int          # the seed's name for admitted this tick
    waiting_len: int          # accepted, still waiting for admission
    kv_blocks_free: int       # free list only: cached prefix blocks are not counted
    kv_blocks_cached: int     # unreferenced cached prefix blocks (reclaimable)
    kv_blocks_total: int      # usable blocks (the null block excluded)
    ssm_slots_used: int       # SSM snapshot pool occupancy
    ssm_slots_total: int
    mtp_mode: str             # "off" until the MTP gate exists
    delivered_tps: float      # from the MTP gate; 0.0 without one
    steps_total: int          # the seed's name for ticks run, idle ones included
    published_at: float
    requests_len: int = 0           # accepted requests not yet finished
    prefix_query_tokens: int = 0    # prompt tokens looked up in the prefix cache, ever
    prefix_hit_tokens: int = 0      # of which found
    # Multi-LoRA (empty with LoRA off): device slots for adapters, the adapters holding one,
    # running sequences per adapter, adapters that waiting requests name, queued rotations.
    max_loras: int = 0
    lora_loaded: tuple[str, ...] = ()
    lora_running: tuple[tuple[str, int], ...] = ()
    lora_waiting: tuple[str, ...] = ()
    rotations_waiting: int = 0
    # Multi-turn sessions: open ones, and the KV blocks their latest turns pin.
    sessions_open: int = 0
    session_pinned_blocks: int = 0

    @property
    def running_seqs(self) -> int:
        return self.active_seqs + self.prefilling_seqs

    @property
    def kv_blocks_used(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_free - self.kv_blocks_cached

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
