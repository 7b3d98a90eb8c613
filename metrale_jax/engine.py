"""The offline API: `LLM(model=...).generate(prompts, params)`, vLLM-shaped.

For now requests run through a simple batched loop (admit while blocks and slots last, pack
prefill chunks and decodes into one ragged step under the token budget, preempt the newest
sequence by recompute when a decode finds no free block). The tick-loop scheduler replaces
this loop; the step, the runner and the outputs stay.
"""

from __future__ import annotations

import collections
import itertools
import logging
import random
from collections.abc import Callable, Iterable, Iterator, Sequence as Seq

from metrale_jax.cache import BlockPool, SlotPool
from metrale_jax.config import EngineConfig
from metrale_jax.loader.resolve import LoadedModel, load
from metrale_jax.outputs import RequestOutput
from metrale_jax.request import RequestError, SamplingParams
from metrale_jax.runner.inputs import RowChunk
from metrale_jax.runner.model_runner import ModelRunner, RowResult, ScheduledRow
from metrale_jax.sequence import Sequence, position_logprobs

PromptInput = str | dict
logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, *, engine_config: EngineConfig | None = None,
                 **engine_overrides):
        loaded: LoadedModel = load(model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        engine = engine_config or EngineConfig()
        if engine_overrides:
            engine = engine.replace(**engine_overrides)
        if engine.max_seq_len > loaded.config.max_position_embeddings:
            logger.warning("max_seq_len %d exceeds what %s was built for; using %d",
                           engine.max_seq_len, loaded.name,
                           loaded.config.max_position_embeddings)
            engine = engine.replace(max_seq_len=loaded.config.max_position_embeddings)
        self.engine_config = engine
        self.runner = ModelRunner(loaded.model, self.engine_config)
        self._check_capacity()
        self.blocks = BlockPool(self.runner.num_blocks)
        self.slots = SlotPool(self.runner.num_slots)
        self._ids = itertools.count()
        self._seeds = random.Random(self.engine_config.seed)

    def _check_capacity(self) -> None:
        need = self.engine_config.max_blocks_per_seq
        have = self.runner.num_blocks - 1
        if self.model_config.attention_layers and have < need:
            raise ValueError(
                f"num_kv_blocks: the KV pool has {have} usable blocks but one sequence of "
                f"max_seq_len={self.engine_config.max_seq_len} needs {need}")

    # ---- requests -------------------------------------------------------------------------

    def _prompt_ids(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not all(isinstance(t, int) and 0 <= t < self.model_config.vocab_size for t in ids):
                raise RequestError("prompt_token_ids: every id must be an integer in "
                                   f"[0, {self.model_config.vocab_size})")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._prompt_ids(prompt["prompt"])
        raise RequestError("prompt: expected a string or {'prompt_token_ids': [...]}, got "
                           f"{type(prompt).__name__}")

    def _make_sequences(self, prompt: PromptInput, params: SamplingParams,
                        ) -> tuple[str, str | None, list[Sequence]]:
        text, ids = self._prompt_ids(prompt)
        max_len = self.engine_config.max_seq_len
        if not ids:
            raise RequestError("prompt: is empty")
        if len(ids) >= max_len:
            raise RequestError(f"prompt: {len(ids)} tokens leave no room to generate within "
                               f"max_seq_len={max_len}")
        params.check_against(self.model_config.vocab_size, self.engine_config.max_logprobs)
        request_id = str(next(self._ids))
        base_seed = params.seed if params.seed is not None else self._seeds.getrandbits(32)
        seqs = [Sequence(
            request_id=request_id, index=i, prompt_ids=list(ids), params=params,
            seed=(base_seed + 0x9E3779B1 * i) & 0xFFFFFFFF,
            detok=self.tokenizer.incremental(ids, skip_special_tokens=params.skip_special_tokens),
            eos_token_id=self.tokenizer.eos_token_id, max_len=max_len,
            want_prompt_logprobs=(i == 0 and params.prompt_logprobs is not None))
            for i in range(params.n)]
        return request_id, text, seqs

    # ---- the offline API ------------------------------------------------------------------

    def generate(self, prompts: PromptInput | Seq[PromptInput],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"sampling_params: {len(params_list)} given for "
                               f"{len(prompts)} prompts")
        requests = [self._make_sequences(p, sp) for p, sp in zip(prompts, params_list)]
        self._run([s for _, _, seqs in requests for s in seqs])
        return [RequestOutput(request_id=rid, prompt=text, prompt_token_ids=seqs[0].prompt_ids,
                              prompt_logprobs=seqs[0].prompt_logprobs,
                              outputs=[s.completion() for s in seqs], finished=True)
                for rid, text, seqs in requests]

    def stream(self, prompt: PromptInput, params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is generated (held back only where it
        could still turn into a stop string)."""
        _, _, seqs = self._make_sequences(prompt, params or SamplingParams())
        deltas: collections.deque[str] = collections.deque()
        for _ in self._steps(seqs, on_step=lambda: deltas.append(seqs[0].stream_delta())):
            while deltas:
                yield deltas.popleft()
        yield seqs[0].stream_delta()

    # ---- the simple batched loop ----------------------------------------------------------

    def _run(self, seqs: list[Sequence]) -> None:
        for _ in self._steps(seqs):
            pass

    def _steps(self, seqs: Iterable[Sequence], on_step: Callable[[], None] | None = None,
               ) -> Iterator[None]:
        waiting = collections.deque(seqs)
        running: list[Sequence] = []
        try:
            while waiting or running:
                self._admit(waiting, running)
                rows, scheduled = self._schedule(waiting, running)
                results = self.runner.run(rows)
                for seq, row, result in zip(scheduled, rows, results):
                    self._commit(seq, row, result)
                for seq in [s for s in running if s.finished]:
                    self._release(seq)
                    running.remove(seq)
                if on_step:
                    on_step()
                yield
        finally:
            for seq in running:
                self._release(seq)

    def _blocks_for(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.engine_config.block_size) - len(seq.block_table))

    def _admit(self, waiting: collections.deque, running: list[Sequence]) -> None:
        needs_slot = bool(self.model_config.mamba_layers)
        while waiting and len(running) < self.engine_config.max_batch_size:
            seq = waiting[0]
            first = min(len(seq.all_ids), self.engine_config.max_tokens_per_tick)
            if not self.blocks.can_allocate(self._blocks_for(seq, first)):
                break
            waiting.popleft()
            if needs_slot:
                seq.slot = self.slots.allocate()
            running.append(seq)

    def _schedule(self, waiting: collections.deque, running: list[Sequence],
                  ) -> tuple[list[ScheduledRow], list[Sequence]]:
        budget = self.engine_config.max_tokens_per_tick
        rows: list[ScheduledRow] = []
        scheduled: list[Sequence] = []
        # Decodes first: they are one token each and keep latency steady; prefills fill the rest.
        for seq in sorted(running, key=lambda s: s.in_prefill):
            if budget == 0:
                break
            chunk = seq.next_chunk(budget)
            while not self._grow(seq, seq.num_computed + len(chunk)):
                # Preempt the newest sequence that has no row in this step yet.
                victims = [s for s in running if s is not seq and s not in scheduled]
                if not victims:
                    chunk = []
                    break
                self._preempt(victims[-1], running, waiting)
            if not chunk:
                continue
            targets = (seq.prompt_targets(seq.num_computed, len(chunk))
                       if seq.prompt_logprobs is not None and seq.in_prefill else ())
            rows.append(ScheduledRow(RowChunk(chunk, seq.num_computed, list(seq.block_table),
                                              seq.slot), seq.row_sampling(), targets))
            scheduled.append(seq)
            budget -= len(chunk)
        return rows, scheduled

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        extra = self._blocks_for(seq, num_tokens)
        if not self.blocks.can_allocate(extra):
            return False
        seq.block_table.extend(self.blocks.allocate(extra))
        return True

    def _preempt(self, seq: Sequence, running: list[Sequence], waiting: collections.deque,
                 ) -> None:
        """Free a sequence's blocks and slot; it recomputes its tokens when readmitted."""
        self._release(seq)
        seq.num_computed = 0
        if seq.want_prompt_logprobs:
            seq.prompt_logprobs = [None]  # recomputed with the prompt
        running.remove(seq)
        waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.free(seq.block_table)
        seq.block_table = []
        if seq.slot:
            self.slots.free(seq.slot)
            seq.slot = 0

    def _commit(self, seq: Sequence, row: ScheduledRow, result: RowResult) -> None:
        seq.num_computed += len(row.chunk.tokens)
        if seq.prompt_logprobs is not None and result.prompt_logprobs is not None:
            n = seq.params.prompt_logprobs
            for i, target in enumerate(row.targets):
                if target < 0:
                    continue
                seq.prompt_logprobs.append(position_logprobs(
                    result.prompt_top_ids[i], result.prompt_top_logprobs[i], n, target,
                    float(result.prompt_logprobs[i]), int(result.prompt_ranks[i]),
                    self.tokenizer))
        if seq.num_computed < len(seq.all_ids) or seq.finished:
            return  # a prefill chunk short of the end samples nothing
        top = None
        if seq.logprobs is not None:
            top = position_logprobs(result.top_ids, result.top_logprobs, seq.params.logprobs,
                                    result.token, result.logprob, result.rank, self.tokenizer)
        seq.append(result.token, result.logprob, top, self.tokenizer)
