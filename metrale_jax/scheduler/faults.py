"""Step failures: what the tick loop does when a step raises (host only, no jax).

A step that raises at dispatch or at read-back fails the requests in it: they may be what
broke it, so running them again could fail forever. Everyone else keeps being served. If the
failure consumed the device caches (they are donated to the step), the runner re-allocates
them and every sequence that held state there recomputes exactly from its tokens, as after a
preemption. A few failed steps in a row mean the engine itself is broken, not one request:
the loop then stops and answers everything it holds with an error rather than fail forever.
"""

from __future__ import annotations

import dataclasses

# Failed steps in a row (no step read back in between) after which the loop stops: one bad
# request fails one step; several in a row point at the device or the engine.
MAX_STEP_FAILURES_IN_A_ROW = 3


class EngineFailed(RuntimeError):
    """The loop stopped after repeated step failures; the message says why."""


@dataclasses.dataclass
class StepFailures:
    """Counts failed steps in a row; a step read back successfully resets the count."""

    limit: int = MAX_STEP_FAILURES_IN_A_ROW
    in_a_row: int = 0
    last: str = ""            # "<where>: <exception>" of the latest failure

    def failed(self, where: str, exc: BaseException) -> None:
        self.in_a_row += 1
        self.last = f"{where}: {type(exc).__name__}: {exc}"

    def succeeded(self) -> None:
        self.in_a_row = 0

    @property
    def exhausted(self) -> bool:
        return self.in_a_row >= self.limit

    def request_error(self) -> str:
        """What a request of the failed step is told."""
        return f"the engine failed the step running this request ({self.last})"

    def halt_reason(self) -> str:
        return f"{self.in_a_row} steps in a row failed (last at {self.last})"
