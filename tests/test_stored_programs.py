"""Stored step programs (runner/stored_step.py, runner/program_store.py): a second start
traces no step, runs exactly what a direct jit runs, and an entry that is corrupt or filed
for something else is never used: that variant is built anew, with a warning."""

from __future__ import annotations

import logging
import pathlib

import jax
import pytest

from metrale_jax import LLM, SamplingParams
from metrale_jax.runner import program_store
from metrale_jax.runner.program_store import ProgramStore
from tests.jax_events import TRACE, EventWatch

ENGINE = dict(max_batch_size=2, max_tokens_per_tick=16, max_seq_len=64, block_size=8,
              num_kv_blocks=24, seq_buckets=(2,), token_buckets=(16,), query_buckets=(1, 16),
              block_buckets=(8,), max_logprobs=2)
PROMPTS = ["To be, or not to be", "x", "A prompt long enough for a second prefill chunk of it"]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
          SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=1),
          SamplingParams(temperature=0.7, top_p=0.9, seed=3, max_tokens=6, ignore_eos=True)]


def _outputs(llm: LLM) -> list:
    return [(c.token_ids, [sorted(e.items()) for e in c.logprobs or []])
            for o in llm.generate(PROMPTS, PARAMS) for c in o.outputs]


def _entries(directory) -> list:
    return sorted(directory.glob(f"*{program_store.SUFFIX}"))


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("programs")


@pytest.fixture(scope="module")
def direct():
    """What the plain jitted step produces (no store)."""
    llm = LLM(**ENGINE, program_cache="none")
    yield _outputs(llm)
    llm.engine.close()


@pytest.fixture(scope="module")
def first(store_dir):
    """The first start: exports every step variant into the store."""
    llm = LLM(**ENGINE, program_cache=str(store_dir))
    yield llm
    llm.engine.close()


def test_first_start_files_one_program_per_step_shape_and_sampler(first, store_dir):
    # Steps with prefill chunks sample in a program of their own, one per row count.
    shapes = first.runner.warmup_shapes()
    samplers = {shape.rows for shape in shapes if shape.query_len > 1}
    assert samplers
    assert len(_entries(store_dir)) == len(shapes) + len(samplers)


def test_stored_programs_give_exactly_the_direct_results(first, direct):
    assert _outputs(first) == direct


def test_second_start_traces_no_step_and_compiles_nothing_after_warmup(first, store_dir,
                                                                      direct):
    with EventWatch(TRACE) as watch:
        llm = LLM(**ENGINE, program_cache=str(store_dir))
    assert not any(name in ("_forward", "_sample_rows", "flat_step")
                   for name in watch.names), watch.names
    before = llm.runner.counter.count
    assert _outputs(llm) == direct
    assert llm.runner.counter.count == before
    llm.engine.close()


def test_corrupt_and_foreign_entries_fall_back_with_a_warning(first, store_dir, direct,
                                                              caplog):
    entries = _entries(store_dir)
    assert len(entries) >= 2
    blob = entries[0].read_bytes()
    entries[0].write_bytes(blob[:-100])   # truncated
    entries[1].write_bytes(blob)          # another shape's program under this one's name
    with caplog.at_level(logging.WARNING, logger="metrale_jax.runner.program_store"):
        llm = LLM(**ENGINE, program_cache=str(store_dir))
    warned = [r.getMessage() for r in caplog.records]
    assert any("checksum mismatch" in m for m in warned), warned
    assert any("filed for other" in m for m in warned), warned
    assert _outputs(llm) == direct
    llm.engine.close()
    # Both were filed again, intact: the next start loads them without a word.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="metrale_jax.runner.program_store"):
        LLM(**ENGINE, program_cache=str(store_dir)).engine.close()
    assert caplog.records == []


def test_an_entry_is_only_returned_for_its_exact_key(tmp_path, monkeypatch):
    store = ProgramStore(tmp_path)
    store.save("shape A", b"payload A")
    assert store.load("shape A") == b"payload A"
    assert store.load("shape B") is None
    # Another jax (or code, or machine): the same description is another key.
    monkeypatch.setattr(program_store, "environment_key", lambda: "jax 0.0.0")
    assert store.load("shape A") is None


def test_auto_follows_the_jax_compilation_cache():
    cache_dir = jax.config.jax_compilation_cache_dir  # set for the tests by conftest.py
    assert ProgramStore.from_setting("auto").directory == (
        pathlib.Path(cache_dir) / program_store.SUBDIR)
    assert ProgramStore.from_setting("none") is None
