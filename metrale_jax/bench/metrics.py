"""What a benchmark run reports: offline rates, and serving latency distributions
(TTFT, TPOT, ITL, end-to-end) with goodput against SLOs, shaped like `vllm bench serve`."""

from __future__ import annotations

import dataclasses

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclasses.dataclass
class OfflineResult:
    """One offline run: every request generated its full output_len."""
    engine: str
    concurrency: int
    requests: int
    input_tokens: int
    output_tokens: int
    elapsed_s: float           # measured window only
    compile_s: float = 0.0     # warm-up (compilation and first-call costs), kept apart
    extra: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        t = max(self.elapsed_s, 1e-9)
        return {"engine": self.engine, "concurrency": self.concurrency,
                "requests": self.requests, "input_tokens": self.input_tokens,
                "output_tokens": self.output_tokens, "elapsed_s": round(self.elapsed_s, 4),
                "compile_s": round(self.compile_s, 3),
                "requests_per_s": round(self.requests / t, 4),
                "input_tokens_per_s": round(self.input_tokens / t, 2),
                "output_tokens_per_s": round(self.output_tokens / t, 2),
                "total_tokens_per_s": round((self.input_tokens + self.output_tokens) / t, 2),
                **self.extra}


def distribution(values_s: list[float]) -> dict:
    """mean / median / p90 / p99 of a list of seconds, in milliseconds."""
    if not values_s:
        return {"mean_ms": None, "median_ms": None, "p90_ms": None, "p99_ms": None}
    arr = np.asarray(values_s, dtype=np.float64) * 1e3
    out = {"mean_ms": round(float(arr.mean()), 3)}
    for p in PERCENTILES:
        key = "median_ms" if p == 50 else f"p{p}_ms"
        out[key] = round(float(np.percentile(arr, p)), 3)
    return out


@dataclasses.dataclass
class RequestRecord:
    """One streamed request, timed on the client's monotonic clock."""
    input_len: int
    sent_at: float = 0.0
    ttft_s: float | None = None
    itl_s: list[float] = dataclasses.field(default_factory=list)  # one gap per token
    e2e_s: float | None = None
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class SLO:
    """Goodput counts the requests that meet every SLO given (milliseconds)."""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, r: RequestRecord) -> bool:
        checks = ((self.ttft_ms, r.ttft_s), (self.tpot_ms, r.tpot_s), (self.e2e_ms, r.e2e_s))
        return all(limit is None or (value is not None and value * 1e3 <= limit)
                   for limit, value in checks)

    def as_dict(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


def serving_summary(records: list[RequestRecord], duration_s: float, slo: SLO) -> dict:
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_len for r in ok)
    t = max(duration_s, 1e-9)
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            errors[r.error or "no tokens"] = errors.get(r.error or "no tokens", 0) + 1
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "errors": errors,
        "duration_s": round(duration_s, 4),
        "input_tokens": in_tokens, "output_tokens": out_tokens,
        "requests_per_s": round(len(ok) / t, 4),
        "output_tokens_per_s": round(out_tokens / t, 2),
        "total_tokens_per_s": round((in_tokens + out_tokens) / t, 2),
        "goodput_requests_per_s": round(sum(slo.met(r) for r in ok) / t, 4),
        "slo": slo.as_dict(),
        "ttft": distribution([r.ttft_s for r in ok]),
        "tpot": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl": distribution([g for r in ok for g in r.itl_s]),
        "e2e": distribution([r.e2e_s for r in ok]),
    }
