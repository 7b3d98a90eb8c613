"""The scheduler snapshot: what `/metrics` and the admin API read (the seed's fields)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SchedulerSnapshot:
    active_seqs: int          # decoding
    prefilling_seqs: int
    swapped_seqs: int         # parked: swapped to disk plus preempted for recompute
    pending_len: int          # newly admitted this tick
    waiting_len: int          # still held back in pending
    kv_blocks_free: int       # free list only: cached prefix blocks are not counted
    kv_blocks_cached: int     # unreferenced cached prefix blocks (reclaimable)
    kv_blocks_total: int
    ssm_slots_used: int       # SSM snapshot pool occupancy
    ssm_slots_total: int
    mtp_mode: str             # "off" until the MTP gate exists
    delivered_tps: float      # from the MTP gate; 0.0 without one
    steps_total: int
    published_at: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)
