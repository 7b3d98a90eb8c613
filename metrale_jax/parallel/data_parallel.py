"""`DataParallelLLM`: M engines, each on its own device group, behind one prefix-affinity
router (the offline API; `LLM.generate`'s shape).

Each engine is a whole `LLMEngine` with its own scheduler, caches and tick loop, built on
devices `[i * tp, (i + 1) * tp)`; nothing is shared between them but the router, which
sends each request where its prompt's prefix went before (parallel/router.py). Here the
engines tick in turn on the calling thread: a tick only dispatches its step (JAX runs it
asynchronously), so the engines' devices work at the same time while the host plans the
next engine's tick.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from metrale_jax.engine import LLMEngine, PromptInput, request_output
from metrale_jax.outputs import RequestOutput
from metrale_jax.parallel.config import ParallelConfig
from metrale_jax.parallel.placement import device_groups
from metrale_jax.parallel.router import PrefixAffinityRouter, RouterConfig
from metrale_jax.request import RequestError, SamplingParams


class DataParallelLLM:
    def __init__(self, model: str | None = None, *, data_parallel_size: int,
                 tensor_parallel_size: int = 1, router_config: RouterConfig | None = None,
                 **engine_kwargs):
        """`engine_kwargs`: what `LLMEngine` takes, the same for every engine."""
        parallel = ParallelConfig(tensor_parallel_size, data_parallel_size)
        self.engines = [LLMEngine(model, devices=group, parallel=parallel, **engine_kwargs)
                        for group in device_groups(parallel)]
        self.tokenizer = self.engines[0].tokenizer
        self.router = PrefixAffinityRouter(router_config or RouterConfig(
            num_engines=data_parallel_size,
            block_size=self.engines[0].engine_config.block_size))
        self._ids = itertools.count()
        self.last_engines: list[int] = []

    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 ) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise RequestError(f"sampling_params: {len(params_list)} given for "
                               f"{len(prompts)} prompts")
        placed = [self._submit(p, sp) for p, sp in zip(prompts, params_list)]
        while not all(r.finished for _, r in placed):
            busy = {i for i, r in placed if not r.finished}
            for i in sorted(busy):  # an engine with nothing left of this batch stays idle
                self.engines[i].step()
        for engine in self.engines:
            engine.drain()
        for _, request in placed:
            self.router.finished(request.request_id)
        self.last_engines = [i for i, _ in placed]  # which engine served each prompt
        return [request_output(r, self.tokenizer) for _, r in placed]

    def _submit(self, prompt: PromptInput, params: SamplingParams):
        request_id = str(next(self._ids))
        _, ids = self.engines[0].prompt_ids(prompt)
        index = self.router.route(request_id, ids)
        engine = self.engines[index]
        request = engine.make_request(prompt, params, request_id=request_id)
        engine.submit(request)
        return index, request

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
