"""Admission policies: which pending sequences a tick admits first."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from metrale_jax.sequence import Sequence


class AdmissionPolicy(Protocol):
    name: str

    def order(self, pending: Seq[Sequence]) -> list[Sequence]:
        """Pending sequences in the order they should be admitted."""
        ...


class FCFS:
    name = "fcfs"

    def order(self, pending: Seq[Sequence]) -> list[Sequence]:
        return sorted(pending, key=lambda s: (s.arrival, s.order))


class Priority:
    """Lower `priority` values first (vLLM's convention); FCFS within a priority."""

    name = "priority"

    def order(self, pending: Seq[Sequence]) -> list[Sequence]:
        return sorted(pending, key=lambda s: (s.priority, s.arrival, s.order))


POLICIES = {p.name: p for p in (FCFS, Priority)}


def make_policy(name: str) -> AdmissionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"policy: unknown admission policy {name!r}; "
                         f"choose one of {sorted(POLICIES)}") from None
