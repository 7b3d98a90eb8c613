"""When the host waits for the step running ahead of it: every reason, in one place.

With the pipeline on, the host dispatches step N+1 (fed by step N's sampled tokens, still on
the device) before it reads step N's results. Settling — waiting for the step ahead and
committing its results — is needed only when what the host is about to do depends on them.
"""

from __future__ import annotations


def must_settle(*, pipeline: bool = True, batch_changes: bool = False,
                penalties: bool = False, needs_room: bool = False,
                empty_batch: bool = False, stopping: bool = False,
                speculative: bool = False, grammar: bool = False) -> bool:
    """True when any reason holds; each call site passes the reasons it can know:

    pipeline      — False: the plain loop reads every step back before the next tick.
    batch_changes — phase 3: this tick starts or continues a prefill or may resume a parked
                    sequence (their chunks and memory depend on every token read back).
    penalties     — a decoding sequence uses repetition/presence/frequency penalties. The
                    runner keeps token histories on the device (runner/slot_tables.py),
                    so a pipelined penalized decode is exact too: this reason is caution.
    needs_room    — a spill or preemption is about to free a sequence's memory: no step may
                    still be writing to it, and its counts must be final.
    empty_batch   — nothing to dispatch: nothing to overlap the read-back with.
    stopping      — the loop stops, or a caller drains the engine (`LLMEngine.drain`).
    speculative   — this tick runs the speculative step, or the step ahead is one: a
                    sequence's next row starts after the drafts it accepted, which only
                    the read-back says; unless every decode can run ahead of it
                    (`Sequence.can_run_ahead`: the device then starts each row there).
    grammar       — a decoding sequence is grammar-constrained: the mask of its next token
                    depends on the token the step ahead is sampling, so the matcher must
                    take that token first. Settling is the simple exact choice (no
                    speculative masks); it gives up the overlap only while such a sequence
                    decodes (see metrale_jax/grammar).
    """
    return (not pipeline or batch_changes or penalties or needs_room or empty_batch
            or stopping or speculative or grammar)
