"""The async streaming API: deltas, aborts, bad input next to good requests, telemetry."""

from __future__ import annotations

import asyncio

import pytest

from metrale_jax.async_engine import AsyncLLM
from metrale_jax.request import RequestError, SamplingParams

ENGINE = dict(max_batch_size=4, max_tokens_per_tick=32, max_seq_len=64, seq_buckets=(4,),
              token_buckets=(16, 32), query_buckets=(1, 8, 32), block_size=8,
              num_kv_blocks=40, block_buckets=(8,), max_logprobs=2)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    llm = AsyncLLM(**ENGINE)
    llm.start()
    yield llm
    llm.shutdown(timeout=30)


async def _collect(stream):
    text, ids, last = "", [], None
    async for delta in stream:
        text += delta.text
        ids += delta.token_ids
        last = delta
    return text, ids, last


def _offline(engine, prompt):
    # The same engine thread answers a solo request: the reference.
    async def solo():
        return await _collect(await engine.generate(prompt, GREEDY))
    return asyncio.run(solo())


def test_streams_equal_solo_and_finish(engine):
    prompts = ["To be, or not", "What light", "x", "Now is the winter"]
    solo = [_offline(engine, p) for p in prompts]

    async def together():
        streams = [await engine.generate(p, GREEDY) for p in prompts]
        return await asyncio.gather(*(_collect(s) for s in streams))

    results = asyncio.run(together())
    for (text, ids, last), (stext, sids, _) in zip(results, solo):
        assert ids == sids and text == stext
        assert last.finish_reason == "length" and len(ids) == 8


def test_bad_input_is_rejected_where_it_enters_and_others_finish(engine):
    async def scenario():
        good = await engine.generate("Once upon a time", GREEDY)
        errors = []
        for prompt, params in [("", GREEDY), ("word " * 100, GREEDY),
                               ({"prompt_token_ids": [5, -1]}, GREEDY)]:
            with pytest.raises(RequestError) as info:
                await engine.generate(prompt, params)
            errors.append(str(info.value))
        for kwargs in (dict(max_tokens=0), dict(stop=[3]), dict(stop=[""])):
            with pytest.raises(RequestError):
                SamplingParams(**kwargs)
        return errors, await _collect(good)

    errors, (text, ids, last) = asyncio.run(scenario())
    assert "prompt" in errors[0] and "max_seq_len" in errors[1]
    assert "prompt_token_ids" in errors[2]
    assert len(ids) == 8 and last.finish_reason == "length"


def test_consumer_that_stops_aborts_and_blocks_come_back(engine):
    async def scenario():
        stream = await engine.generate("A long story", SamplingParams(
            temperature=0.0, max_tokens=40, ignore_eos=True), request_id="goes-away")
        async for _ in stream:
            break  # the client goes away after the first delta
        await stream.aclose()
        # Ask again until the engine thread has processed the abort (no sleeping).
        for _ in range(200):
            done = await _collect(await engine.generate("ok", SamplingParams(
                temperature=0.0, max_tokens=1)))
            if "goes-away" not in engine.engine.core.requests:
                return done
        raise AssertionError("the aborted request never left the engine")

    asyncio.run(scenario())
    pool = engine.engine.core.pool
    assert pool.num_used == 0
    phases = engine.engine.core.tel.phases()
    assert phases["drain"].count > 0 and phases["dispatch"].count > 0
