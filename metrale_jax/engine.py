"""LLMEngine: the model, its runner and the tick loop, plus request validation.

`LLM` (offline, vLLM-shaped) and `AsyncLLM` (streaming, for the server) are thin fronts:
both build `Request`s here and drive the same `SchedulerCore` through `step()` / `run()`,
`drain()` and `snapshot()`; neither reaches into the core.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import pathlib
import random
import shutil
import threading
from collections.abc import Sequence as Seq

from metrale_jax.cache.spill import SpillStore
from metrale_jax.cache.spill_dirs import make_private_dir, remove_stale_dirs
from metrale_jax.cache.tiers import StateTier
from metrale_jax.config import EngineConfig
from metrale_jax.grammar.backend import check_installed
from metrale_jax.loader.resolve import load
from metrale_jax.lora.config import LoraConfig
from metrale_jax.lora.registry import AdapterLoader, AdapterRegistry, peft_loader
from metrale_jax.lora.request import LoRARequest
from metrale_jax.lora.weights import LoraError
from metrale_jax.outputs import RequestOutput
from metrale_jax.parallel import distributed as multi_process
from metrale_jax.parallel.config import ParallelConfig
from metrale_jax.parallel.placement import param_placement
from metrale_jax.request import Request, RequestError, SamplingParams, check_context
from metrale_jax.runner.model_runner import ModelRunner
from metrale_jax.scheduler.core import SchedulerCore
from metrale_jax.scheduler.levers import Levers, LeverValues
from metrale_jax.scheduler.policy import make_policy
from metrale_jax.scheduler.sessions import CloseSession
from metrale_jax.scheduler.snapshot import SchedulerSnapshot
from metrale_jax.scheduler.state import LoadAdapter, OutputSink, UnloadAdapter
from metrale_jax.sequence import Sequence, decode_logprobs
from metrale_jax.spec.config import SpeculativeConfig
from metrale_jax.spec.gate import GateConfig, MtpGate
from metrale_jax.telemetry import Clock, MonotonicClock

PromptInput = str | dict
logger = logging.getLogger(__name__)


class _NullSink:
    def on_update(self, request: Request, seq: Sequence) -> None:
        pass

    def on_finished(self, request: Request) -> None:
        pass


def model_default_speculation(num_mtp_modules: int) -> SpeculativeConfig | None:
    """What `speculative_config="auto"` means: MTP with the gate on auto where the model
    has MTP modules (up to two drafts), plain decoding where it has none."""
    if not num_mtp_modules:
        return None
    return SpeculativeConfig(num_speculative_tokens=min(2, num_mtp_modules), gate="auto")


class LLMEngine:
    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None,
                 clock: Clock | None = None, sink: OutputSink | None = None,
                 check_every_tick: bool = False, spill_backend=None, dtype: str | None = None,
                 speculative_config=None, enable_lora: bool = False,
                 max_loras: int | None = None, max_lora_rank: int | None = None,
                 runner=None, adapter_loader: AdapterLoader | None = None,
                 tensor_parallel_size: int | None = None, devices=None,
                 distributed=None, **engine_overrides):
        """`enable_lora`, `max_loras`, `max_lora_rank`: vLLM's names for `EngineConfig.lora`;
        `tensor_parallel_size`: vLLM's name for `EngineConfig.parallel` (metrale_jax/parallel);
        `devices`: the device group the engine runs on (data parallel; None: the first);
        `distributed`: one engine over several processes, lockstep (parallel/distributed.py):
        {"num_processes", "process_id", "coordinator_address"} or "env".
        `runner`: a runner built elsewhere instead of the model's (tests: the fake one);
        `adapter_loader`: how adapter directories are read (default: PEFT)."""
        engine = engine_config or EngineConfig()
        parallel = engine_overrides.pop("parallel", engine.parallel)
        if tensor_parallel_size is not None:
            parallel = dataclasses.replace(parallel, tensor_parallel_size=tensor_parallel_size)
        parallel = multi_process.with_distributed(parallel, distributed)
        if isinstance(parallel, ParallelConfig):  # (else EngineConfig names the field)
            multi_process.initialize(parallel)  # before anything touches a JAX backend
        if parallel != engine.parallel:
            engine_overrides["parallel"] = parallel
        # The parameters load straight onto the shards the runner keeps them on (a runner
        # built elsewhere places its own).
        loaded = load(model, dtype, placement=param_placement(parallel, devices)
                      if isinstance(parallel, ParallelConfig) and runner is None else None)
        self.model_name = loaded.name
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        if speculative_config == "auto":
            speculative_config = model_default_speculation(loaded.config.num_mtp_modules)
        if speculative_config is not None:  # vLLM's name for it
            engine_overrides["speculative"] = speculative_config
        lora = lora_config(enable_lora, max_loras, max_lora_rank)
        if lora is not None:
            engine_overrides["lora"] = lora
        if engine_overrides:
            engine = engine.replace(**engine_overrides)
        if engine.speculative is not None:
            engine.speculative.check_model(loaded.config.num_mtp_modules, loaded.name)
        multi_process.check_engine(engine.parallel, mtp_gate=engine.speculative.gate
                                   if engine.speculative is not None else None)
        if engine.max_seq_len > loaded.config.max_position_embeddings:
            logger.warning("max_seq_len %d exceeds what %s was built for; using %d",
                           engine.max_seq_len, loaded.name, loaded.config.max_position_embeddings)
            engine = engine.replace(max_seq_len=loaded.config.max_position_embeddings)
        self.engine_config = engine
        check_installed(engine.structured_outputs_backend)  # at startup, not on a request
        self.runner = runner or ModelRunner(loaded.model, engine,
                                            num_snapshot_slots=engine.num_ssm_snapshots,
                                            devices=devices)
        # Multi-LoRA: the registry of adapters (None: LoRA off); the scheduler owns its slots.
        self.adapters = None
        if engine.lora is not None:
            self.adapters = AdapterRegistry(
                engine.lora.max_loras,
                adapter_loader or peft_loader(loaded.config, engine.lora))
        self._check_capacity()
        self._own_spill_dir = None
        if spill_backend is None and engine.enable_swap:
            spill_backend = SpillStore(pathlib.Path(self._spill_dir()))
        clock = clock or MonotonicClock()
        self._tiers = (self._state_tier(), self._prefix_tier())
        gate = None
        if engine.speculative is not None:
            gate = MtpGate(GateConfig(policy=engine.speculative.gate),
                           num_depths=engine.speculative.num_speculative_tokens, clock=clock)
        self.core = SchedulerCore(
            runner=self.runner, levers=self._levers(),
            policy=make_policy(engine.policy), clock=clock, gate=gate,
            sink=sink or _NullSink(), max_seq_len=engine.max_seq_len,
            block_size=engine.block_size, spill=spill_backend,
            snapshot_slots=list(range(self.runner.num_seq_slots, self.runner.num_slots)),
            check_every_tick=check_every_tick, adapters=self.adapters,
            sessions=engine.sessions, tier=self._tiers[0], prefix_tier=self._tiers[1])
        self._ids = itertools.count()
        self._seeds = random.Random(engine.seed)
        self._grammar = None                 # GrammarCompiler, built on first use
        self._grammar_lock = threading.Lock()

    def _state_tier(self) -> StateTier:
        """Host RAM, then disk under the spill directory (a `tier` subdirectory, its own
        file sets), for session tails memory pressure takes off the device."""
        cfg = self.engine_config.sessions
        store = None
        if cfg.disk_tier_bytes:
            base = self._own_spill_dir or self._spill_dir()
            store = SpillStore(pathlib.Path(base) / "tier", durable=False)
        return StateTier(cfg.host_tier_bytes, cfg.disk_tier_bytes, store)

    def _prefix_tier(self) -> StateTier | None:
        """Host RAM, then disk under the spill directory (`prefix-tier`), for prefix
        blocks and SSM snapshots the device evicts; None when off."""
        cfg = self.engine_config.prefix_tier
        if not cfg.enabled:
            return None
        store = None
        if cfg.disk_bytes:
            base = self._own_spill_dir or self._spill_dir()
            store = SpillStore(pathlib.Path(base) / "prefix-tier", durable=False)
        return StateTier(cfg.host_bytes, cfg.disk_bytes, store)

    def _spill_dir(self) -> str:
        parallel = self.engine_config.parallel
        if self.engine_config.spill_dir is not None:
            if parallel.multi_process:  # each process spills its own (replicated) copy
                return str(pathlib.Path(self.engine_config.spill_dir)
                           / f"process{parallel.process_id}")
            return self.engine_config.spill_dir
        remove_stale_dirs()  # what a killed engine left behind
        self._own_spill_dir = make_private_dir()
        return self._own_spill_dir

    def _levers(self) -> Levers:
        e = self.engine_config
        widest = self.runner.ladders.query[-1]  # no chunk outgrows max_seq_len or the budget
        values = LeverValues(
            max_tokens_per_tick=e.max_tokens_per_tick, max_batch_size=e.max_batch_size,
            admit_watermark=e.admit_watermark,
            prefill_chunk_size=min(e.prefill_chunk_size, widest),
            swap_enabled=e.enable_swap, pipeline_enabled=e.enable_pipeline,
            prefix_cache_enabled=e.enable_prefix_cache,
            mtp_policy=e.speculative.gate if e.speculative is not None else "off")
        limits = {"max_tokens_per_tick": e.max_tokens_per_tick,
                  "max_batch_size": e.max_batch_size,
                  "prefill_chunk_size": widest}
        return Levers(values, limits, speculative=e.speculative is not None)

    def _check_capacity(self) -> None:
        need = self.engine_config.max_blocks_per_seq
        have = self.runner.num_blocks - 1
        if self.model_config.attention_layers and have < need:
            raise ValueError(
                f"num_kv_blocks: the KV pool has {have} usable blocks but one sequence of "
                f"max_seq_len={self.engine_config.max_seq_len} needs {need}")

    @property
    def levers(self) -> Levers:
        return self.core.levers

    def close(self) -> None:
        self.runner.close()
        for tier in self._tiers:  # caches of this process only: their files go too
            if tier is not None:
                tier.clear()
        if self._own_spill_dir:
            shutil.rmtree(self._own_spill_dir, ignore_errors=True)
            self._own_spill_dir = None

    # ---- requests -------------------------------------------------------------------------

    def prompt_ids(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as err:  # a lone UTF-16 surrogate: no tokenizer takes it
                raise RequestError(f"prompt: holds a lone UTF-16 surrogate "
                                   f"(\\u{ord(prompt[err.start]):04x} at character "
                                   f"{err.start})") from None
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in ids):
                raise RequestError("prompt_token_ids: every id must be an integer in "
                                   f"[0, {self.model_config.vocab_size})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self.prompt_ids(prompt["prompt"])
        raise RequestError("prompt: expected a string or {'prompt_token_ids': [...]}, got "
                           f"{type(prompt).__name__}")

    def make_request(self, prompt: PromptInput, params: SamplingParams, *, priority: int = 0,
                     request_id: str | None = None, max_tokens_must_fit: bool = False,
                     lora_name: str | None = None, session_id: str | None = None) -> Request:
        """Validate and tokenize where the request enters; the loop gets a clean Request.
        `lora_name`: a registered adapter (None: the base model); `session_id`: the
        multi-turn session it belongs to (an unknown one opens: scheduler/sessions.py)."""
        self.check_adapter(lora_name)
        check_session_id(session_id)
        if session_id is not None and self.engine_config.parallel.multi_process:
            raise RequestError("session_id: sessions are not supported across processes "
                               "(their time-to-live is wall-clock time, which differs "
                               "between processes)")
        text, ids = self.prompt_ids(prompt)
        max_len = self.engine_config.max_seq_len
        check_context(len(ids), params.max_tokens, max_len,
                      max_tokens_must_fit=max_tokens_must_fit)
        params.check_against(self.model_config.vocab_size, self.engine_config.max_logprobs,
                             self.engine_config.max_logit_bias, self.tokenizer.eos_token_id)
        grammar = self.compile_grammar(params)
        request_id = request_id or str(next(self._ids))
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        seqs = [Sequence(
            request_id=request_id, index=i, prompt_ids=list(ids), params=params,
            seed=(base_seed + 0x9E3779B1 * i) & 0xFFFFFFFF,
            detok=self.tokenizer.incremental(ids, skip_special_tokens=params.skip_special_tokens),
            eos_token_id=self.tokenizer.eos_token_id, max_len=max_len, priority=priority,
            lora_name=lora_name, want_prompt_logprobs=(i == 0 and params.prompt_logprobs is not None),
            grammar_state=grammar.new_state(params.structured_outputs) if grammar else None,
            session_id=session_id)
            for i in range(params.n)]
        return Request(request_id, seqs, text)

    # ---- adapters (multi-LoRA) ------------------------------------------------------------

    def check_adapter(self, lora_name: str | None) -> None:
        """Raises RequestError unless `lora_name` is None or a registered adapter."""
        if lora_name is None:
            return
        if self.adapters is None:
            raise RequestError("lora_request: LoRA is not enabled on this engine (start it "
                               "with enable_lora=True)")
        if lora_name not in self.adapters:
            raise RequestError(f"lora_request: unknown adapter {lora_name!r}")

    def ensure_adapter(self, lora_request: LoRARequest | None) -> str | None:
        """The offline path: read and register the adapter a LoRARequest names (on the
        caller's thread, never the engine's); returns its name. Raises RequestError."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request: expected a LoRARequest or None, got "
                               f"{type(lora_request).__name__}")
        if self.adapters is None:
            raise RequestError("lora_request: LoRA is not enabled on this engine (build "
                               "LLM(..., enable_lora=True))")
        try:
            return self.adapters.ensure(lora_request).name
        except LoraError as err:
            raise RequestError(f"lora_request: {err}") from None

    def submit_rotation(self, command: LoadAdapter | UnloadAdapter) -> None:
        """Queue an adapter command; the engine thread applies it at the next quiescent
        tick and calls its `ack` exactly once."""
        self.core.inbox.submit(command)

    def compile_grammar(self, params: SamplingParams):
        """Compile the request's constraint on the calling thread (cached by its text);
        the compiler, or None when the request has no constraint. Raises RequestError."""
        if params.structured_outputs is None:
            return None
        with self._grammar_lock:
            if self._grammar is None:
                from metrale_jax.grammar.compiler import GrammarCompiler

                self._grammar = GrammarCompiler(
                    self.tokenizer, self.model_config.vocab_size,
                    backend=self.engine_config.structured_outputs_backend)
        self._grammar.compile(params.structured_outputs)
        return self._grammar

    def close_session(self, session_id: str, ack) -> None:
        """Queue the end of a session (DELETE /v1/sessions/{id}); the engine thread calls
        `ack(found, None)` once it has released the session's pins."""
        check_session_id(session_id)
        self.core.inbox.submit(CloseSession(session_id, ack))

    def submit(self, request: Request) -> None:
        if request.request_id in self.core.requests:
            raise RequestError(f"request_id: {request.request_id!r} is already in flight")
        self.core.inbox.submit(request)

    def abort(self, request_id: str) -> None:
        self.core.inbox.abort(request_id)

    def step(self) -> bool:
        """One tick on the calling thread; False once the loop has stopped."""
        return self.core.tick()

    def run(self, wait: float | None = 0.5) -> None:
        """The engine thread's loop (blocks on the inbox when idle, up to `wait` seconds)."""
        self.core.run(wait)

    def drain(self) -> None:
        """Read back the step the pipeline left running, so every output is committed."""
        self.core.drain()

    @property
    def failure(self) -> str | None:
        """Why the loop stopped after repeated step failures (None while it serves)."""
        return self.core.halted

    def close_inbox(self) -> None:
        """No new requests; the loop finishes what it holds, then `run` returns."""
        self.core.inbox.close()

    def snapshot(self) -> SchedulerSnapshot | None:
        """The latest snapshot the engine thread published (safe from any thread)."""
        return self.core.tel.snapshot

    def stats(self) -> dict:
        """Telemetry safe to read from any thread: counters, phase timings, compiles."""
        tel = self.core.tel
        return {"counters": tel.counters(), "phases": tel.phases(),
                "compiled_variants": self.runner.counter.count,
                "compiling_variants": self.runner.compiling}


def lora_config(enable_lora: bool, max_loras: int | None, max_lora_rank: int | None,
                ) -> LoraConfig | None:
    """vLLM's three LoRA arguments as the validated config (None: LoRA off)."""
    if not enable_lora:
        if max_loras is not None or max_lora_rank is not None:
            raise ValueError("max_loras/max_lora_rank: LoRA is off; pass enable_lora=True")
        return None
    given = {"max_loras": max_loras, "max_lora_rank": max_lora_rank}
    return LoraConfig(**{k: v for k, v in given.items() if v is not None})


MAX_SESSION_ID_LEN = 256


def check_session_id(session_id) -> None:
    """A session id is a non-empty string of at most MAX_SESSION_ID_LEN characters."""
    if session_id is None:
        return
    if not isinstance(session_id, str) or not 0 < len(session_id) <= MAX_SESSION_ID_LEN:
        raise RequestError(f"session_id: expected a non-empty string of at most "
                           f"{MAX_SESSION_ID_LEN} characters, got {session_id!r:.80}")


def request_output(request: Request, tokenizer) -> RequestOutput:
    first = request.sequences[0]
    for seq in request.sequences:  # logprob entries leave the engine as token ids
        decode_logprobs(seq.logprobs, tokenizer)
        decode_logprobs(seq.prompt_logprobs, tokenizer)
    return RequestOutput(request_id=request.request_id, prompt=request.prompt_text,
                         prompt_token_ids=first.prompt_ids, prompt_logprobs=first.prompt_logprobs,
                         outputs=[s.completion() for s in request.sequences],
                         finished=request.finished)


class LLM:
    """The offline API: generate() runs the tick loop on the calling thread.

    `warmup=True` (the default) compiles every program serving can run before `LLM()`
    returns, as `metrale serve` does before it answers (vLLM captures its CUDA graphs at
    init the same way), with a progress bar on a terminal and periodic log lines elsewhere;
    with JAX's persistent compilation cache on, later starts load them instead. False
    compiles each step shape the first time a batch needs it: a quicker `LLM()`, a slower
    first `generate`.
    """

    def __init__(self, model: str | None = None, *, warmup: bool = True, **kwargs):
        self.engine = LLMEngine(model, **kwargs)
        self.tokenizer = self.engine.tokenizer
        self.model_config = self.engine.model_config
        self.engine_config = self.engine.engine_config
        self.runner = self.engine.runner
        if warmup:
            self.runner.warmup()

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
                 session_id: str | Seq[str | None] | None = None,
                 ) -> list[RequestOutput]:
        """`lora_request`: one adapter for every prompt, or a list with one entry per
        prompt (None: the base model), as vLLM takes it (needs enable_lora=True).
        `session_id`: the multi-turn session of every prompt, or one per prompt (None:
        none); a session keeps its latest turn for the next (scheduler/sessions.py)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"sampling_params: {len(params_list)} given for "
                               f"{len(prompts)} prompts")
        loras = self._lora_names(lora_request, len(prompts))
        sessions = self._per_prompt("session_id", session_id, len(prompts))
        requests = [self.engine.make_request(p, sp, lora_name=lora, session_id=sid)
                    for p, sp, lora, sid in zip(prompts, params_list, loras, sessions)]
        for request in requests:
            self.engine.submit(request)
        while not all(r.finished for r in requests):
            self.engine.step()
        self.engine.drain()
        return [request_output(r, self.tokenizer) for r in requests]

    def close_session(self, session_id: str) -> bool:
        """End a session now, releasing what it pins; False when none was open."""
        found = []
        self.engine.close_session(session_id, lambda result, _: found.append(result))
        while not found:
            self.engine.step()
        return found[0]

    @staticmethod
    def _per_prompt(name: str, value, num_prompts: int) -> list:
        if isinstance(value, (list, tuple)):
            if len(value) != num_prompts:
                raise RequestError(f"{name}: {len(value)} given for {num_prompts} prompts")
            return list(value)
        return [value] * num_prompts

    def _lora_names(self, lora_request, num_prompts: int) -> list[str | None]:
        if isinstance(lora_request, (list, tuple)):
            if len(lora_request) != num_prompts:
                raise RequestError(f"lora_request: {len(lora_request)} given for "
                                   f"{num_prompts} prompts")
            return [self.engine.ensure_adapter(r) for r in lora_request]
        return [self.engine.ensure_adapter(lora_request)] * num_prompts

    def stream(self, prompt: PromptInput, params: SamplingParams | None = None,
               lora_request: LoRARequest | None = None):
        """Yield the text of one completion as it is generated (held back only where it
        could still turn into a stop string)."""
        request = self.engine.make_request(prompt, params or SamplingParams(),
                                           lora_name=self.engine.ensure_adapter(lora_request))
        self.engine.submit(request)
        seq = request.sequences[0]
        while not request.finished:
            self.engine.step()
            delta = seq.stream_delta()
            if delta:
                yield delta
        self.engine.drain()
        tail = seq.stream_delta()
        if tail:
            yield tail
        if seq.error:
            raise RequestError(seq.error)
