"""Prometheus metrics in the `metrale:` namespace, shaped like vLLM's `vllm:` ones.

Two sources: engine state (the snapshot the engine thread publishes every tick and before it
waits idle, plus its thread-safe telemetry: tick-phase timings, spill counters, compiled
variants) is read through `AsyncLLM` when `/metrics` is scraped, by a custom collector;
request timings (TTFT, time per output token, end-to-end, queue time) and token
counts are observed by the server as deltas arrive, so the engine thread never waits on them.

Data parallel (`--data-parallel-size` M > 1): every engine-level sample carries an `engine`
label, "0" .. "M-1" for each engine and "total" for the engines together (counts and gauges
summed, ratios from the summed counts: `DataParallelCollector`); the request-level metrics
are the server's own and stay unlabelled.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, Metric,
                                    SummaryMetricFamily)

# vLLM's buckets (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class EngineCollector:
    """Reads the engine's published snapshot and telemetry at scrape time."""

    def __init__(self, llm, model_name: str):
        self.llm, self.labels = llm, {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self.labels))
        g.add_metric(list(self.labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self.labels))
        c.add_metric(list(self.labels.values()), value)
        return c

    def collect(self):
        snap, stats = self.llm.snapshot(), self.llm.stats()
        if snap is not None:
            yield from self._snapshot(snap)
        counters = stats["counters"]
        for name, doc in (("spills", "Sequences spilled to disk."),
                          ("spill_failures", "Spills that failed (the sequence stayed)."),
                          ("swap_ins", "Sequences read back from disk."),
                          ("preemptions", "Sequences preempted for recompute."),
                          ("spill_corrupt", "Spill files found corrupt at swap-in (the "
                                            "sequence recomputed)."),
                          ("step_failures", "Steps that raised (their requests failed)."),
                          ("cache_losses", "Failed steps that took the device caches with "
                                           "them (running sequences recomputed).")):
            yield self._counter(f"metrale:num_{name}", doc, counters.get(name, 0))
        yield from self._sessions(counters)
        yield from self._prefix_tier(counters)
        yield from self._spec_decode(counters)
        yield from self._phases(stats["phases"])
        yield self._gauge("metrale:compiled_variants",
                          "Compiled step variants (a rise while serving means a compile).",
                          stats["compiled_variants"])

    def _sessions(self, counters: dict):
        """How sessions ended and what their tails saved."""
        for name, doc in (("sessions_opened", "Sessions opened (an unknown id opens one)."),
                          ("sessions_expired", "Sessions ended by their TTL."),
                          ("sessions_deleted", "Sessions ended by DELETE /v1/sessions/{id}."),
                          ("sessions_evicted", "Sessions ended under memory pressure or "
                                               "their budgets."),
                          ("session_tail_hits", "Turns that started from their session's "
                                                "last turn."),
                          ("session_tail_tokens", "Prompt tokens those turns did not "
                                                  "compute."),
                          ("session_tails_stored", "Tails memory pressure moved to the host "
                                                   "RAM / disk tier."),
                          ("session_tier_restores", "Tails brought back from that tier."),
                          ("session_tier_misses", "Stored tails found unreadable or gone "
                                                  "(the turn computed instead).")):
            yield self._counter(f"metrale:{name}", doc, counters.get(name, 0))

    def _prefix_tier(self, counters: dict):
        """What the prefix tier (host RAM / disk) took from the device and gave back."""
        for name, doc in (("blocks_stored", "Evicted prefix blocks copied to the tier."),
                          ("snapshots_stored", "Evicted SSM snapshots copied to the tier."),
                          ("blocks_restored", "Blocks brought back for a prefix hit."),
                          ("snapshots_restored", "SSM snapshots brought back for a hit."),
                          ("hit_tokens", "Prompt tokens those restores did not compute."),
                          ("misses", "Tier entries found unreadable or gone when wanted.")):
            yield self._counter(f"metrale:prefix_tier_{name}", doc,
                                counters.get(f"prefix_tier_{name}", 0))

    def _spec_decode(self, counters: dict):
        """Speculative decoding, shaped like vLLM's `vllm:spec_decode_*` counters."""
        for name, doc in (("num_drafts", "Sequences that verified drafts in a step."),
                          ("num_draft_tokens", "Draft tokens verified."),
                          ("num_accepted_tokens", "Draft tokens accepted.")):
            yield self._counter(f"metrale:spec_decode_{name}", doc,
                                counters.get(f"spec_decode_{name}", 0))
        prefix = "spec_decode_num_accepted_tokens_per_pos_"
        per_pos = CounterMetricFamily(
            "metrale:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft).",
            labels=[*self.labels, "position"])
        for key in sorted((k for k in counters if k.startswith(prefix)),
                          key=lambda k: int(k[len(prefix):])):
            per_pos.add_metric([*self.labels.values(), key[len(prefix):]], counters[key])
        yield per_pos

    def _snapshot(self, snap):
        """Counts from the published snapshot (vLLM's metric names where they exist)."""
        yield self._gauge("metrale:num_requests_running", "Sequences prefilling or decoding.",
                          snap.running_seqs)
        yield self._gauge("metrale:num_requests_waiting", "Sequences waiting for admission.",
                          snap.waiting_len)
        yield self._gauge("metrale:num_requests_swapped",
                          "Sequences parked: swapped to disk or preempted.", snap.swapped_seqs)
        yield self._gauge("metrale:kv_cache_usage_perc",
                          "KV-cache usage: 1 means every block is held by a sequence.",
                          snap.kv_blocks_used / max(snap.kv_blocks_total, 1))
        yield self._gauge("metrale:kv_cache_free_blocks", "Free KV blocks (cached ones excluded).",
                          snap.kv_blocks_free)
        yield self._gauge("metrale:kv_cache_cached_blocks",
                          "Unreferenced cached prefix blocks (reclaimable).", snap.kv_blocks_cached)
        yield self._gauge("metrale:kv_cache_total_blocks", "Usable KV blocks.",
                          snap.kv_blocks_total)
        yield self._counter("metrale:prefix_cache_queries",
                            "Prompt tokens looked up in the prefix cache.",
                            snap.prefix_query_tokens)
        yield self._counter("metrale:prefix_cache_hits",
                            "Prompt tokens found in the prefix cache.", snap.prefix_hit_tokens)
        yield self._gauge("metrale:prefix_cache_hit_rate",
                          "Prefix-cache hits over queries, in tokens, since start.",
                          snap.prefix_hit_tokens / snap.prefix_query_tokens
                          if snap.prefix_query_tokens else 0.0)
        yield self._counter("metrale:scheduler_steps",
                            "Ticks the scheduler has run, idle ones included (the seed's "
                            "steps_total).", snap.steps_total)
        yield self._gauge("metrale:delivered_tokens_per_second",
                          "The MTP gate's delivered tokens/s (EMA); 0 without speculation.",
                          snap.delivered_tps)
        yield self._gauge("metrale:ssm_snapshot_slots_used",
                          "SSM snapshot slots holding a state (the model's pool).",
                          snap.ssm_slots_used)
        yield self._gauge("metrale:ssm_snapshot_slots_total", "SSM snapshot slots.",
                          snap.ssm_slots_total)
        yield self._gauge("metrale:sessions_open", "Multi-turn sessions open.",
                          snap.sessions_open)
        yield self._gauge("metrale:session_pinned_blocks",
                          "KV blocks the sessions' latest turns pin.", snap.session_pinned_blocks)
        if snap.max_loras:
            yield from self._lora(snap)
        mode = GaugeMetricFamily("metrale:mtp_mode", "The MTP gate's mode this tick (1 for "
                                 "the current one).", labels=[*self.labels, "mode"])
        for name in ("off", "on", "probing"):
            mode.add_metric([*self.labels.values(), name], float(snap.mtp_mode == name))
        yield mode

    def _lora(self, snap):
        """Multi-LoRA. `lora_requests_info` has the shape of vLLM's `vllm:lora_requests_info`
        (adapters as comma-separated label values, the snapshot's time as the value)."""
        info = GaugeMetricFamily(
            "metrale:lora_requests_info", "Running and waiting LoRA adapters.",
            labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        info.add_metric([",".join(name for name, _ in snap.lora_running),
                         ",".join(snap.lora_waiting), str(snap.max_loras)], snap.published_at)
        yield info
        yield self._gauge("metrale:lora_loaded_adapters", "Adapters holding a device slot.",
                          len(snap.lora_loaded))
        yield self._gauge("metrale:lora_rotations_waiting",
                          "Adapter load/unload/replace commands waiting for a quiescent tick.",
                          snap.rotations_waiting)
        running = GaugeMetricFamily("metrale:lora_running_requests",
                                    "Sequences running (prefilling or decoding) per adapter.",
                                    labels=[*self.labels, "lora_name"])
        for name, count in snap.lora_running:
            running.add_metric([*self.labels.values(), name], count)
        yield running

    def _phases(self, phases):
        summary = SummaryMetricFamily("metrale:tick_phase_duration_seconds",
                                      "Time spent in each phase of the tick.",
                                      labels=[*self.labels, "phase"])
        for phase, stats in phases.items():
            summary.add_metric([*self.labels.values(), phase], stats.count, stats.total_s)
        yield summary


class DataParallelCollector:
    """M engines' metrics as one family per name: each engine's samples labelled with its
    index, and the totals (an `EngineCollector` over the group's summed snapshot and
    stats) labelled "total"."""

    def __init__(self, group, model_name: str):
        self.parts = [("total", EngineCollector(group, model_name))] + [
            (str(i), EngineCollector(e, model_name)) for i, e in enumerate(group.engines)]

    def collect(self):
        families: dict[str, Metric] = {}
        for engine, collector in self.parts:
            for family in collector.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = families[family.name] = Metric(family.name, family.documentation,
                                                            family.type)
                for s in family.samples:
                    merged.add_sample(s.name, {**s.labels, "engine": engine}, s.value,
                                      s.timestamp, s.exemplar)
        yield from families.values()


def engine_collector(llm, model_name: str):
    """An `EngineCollector`, or for M > 1 engines a `DataParallelCollector` (an engine
    that does not say how many it is, as the tests' stand-ins, is one)."""
    if getattr(llm, "data_parallel_size", 1) > 1:
        return DataParallelCollector(llm, model_name)
    return EngineCollector(llm, model_name)


class ServerMetrics:
    def __init__(self, llm, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(engine_collector(llm, model_name))
        labels = ["model_name"]
        self.model = model_name

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets,
                             registry=self.registry).labels(model_name)

        self.ttft = hist("metrale:time_to_first_token_seconds",
                         "Time from submission to the first output token.", TTFT_BUCKETS)
        self.tpot = hist("metrale:time_per_output_token_seconds",
                         "Mean time between output tokens of one sequence.", TPOT_BUCKETS)
        self.e2e = hist("metrale:e2e_request_latency_seconds",
                        "Time from submission to the last output.", LATENCY_BUCKETS)
        self.queue = hist("metrale:request_queue_time_seconds",
                          "Time from submission until the engine admitted the request "
                          "(first output less the tick that produced it).", LATENCY_BUCKETS)
        self.prompt_tokens = Counter("metrale:prompt_tokens", "Prompt tokens submitted.",
                                     labels, registry=self.registry).labels(model_name)
        self.generation_tokens = Counter("metrale:generation_tokens", "Tokens generated.",
                                         labels, registry=self.registry).labels(model_name)
        self.success = Counter("metrale:request_success",
                               "Finished sequences by finish reason.",
                               [*labels, "finished_reason"], registry=self.registry)
        self.rejected = Counter("metrale:request_rejected",
                                "Requests answered with an error status, by status.",
                                [*labels, "status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Timings of one submitted prompt and its n sequences."""

    def __init__(self, metrics: ServerMetrics, llm, prompt_tokens: int):
        self.m, self.llm = metrics, llm
        self.t0 = time.monotonic()
        self.first: dict[int, float] = {}   # sequence index -> first token time
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()         # sequence indices that finished
        self.m.prompt_tokens.inc(prompt_tokens)

    def on_delta(self, index: int, new_tokens: int, finish_reason: str | None) -> None:
        t = time.monotonic()
        if new_tokens:
            if not self.first:
                ttft = t - self.t0
                self.m.ttft.observe(ttft)
                phases = self.llm.stats()["phases"]
                tick = sum(phases[p].last_s for p in ("pack", "dispatch", "process"))
                self.m.queue.observe(max(0.0, ttft - tick))
            self.first.setdefault(index, t)
            self.tokens[index] = self.tokens.get(index, 0) + new_tokens
            self.m.generation_tokens.inc(new_tokens)
        if finish_reason is not None:
            self.done.add(index)
            self.m.success.labels(self.m.model, finish_reason).inc()
            n = self.tokens.get(index, 0)
            if n > 1:
                self.m.tpot.observe((t - self.first[index]) / (n - 1))

    def on_done(self) -> None:
        self.m.e2e.observe(time.monotonic() - self.t0)

    def on_abort(self, num_seqs: int) -> None:
        """The client went away: its unfinished sequences count as aborted."""
        left = num_seqs - len(self.done)
        if left > 0:
            self.m.success.labels(self.m.model, "abort").inc(left)
