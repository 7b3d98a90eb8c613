"""`EngineConfig.kernel_backend`: resolution per platform, and the engine's greedy outputs with
the Pallas kernels (interpreted on the CPU) equal those with the XLA references."""

from __future__ import annotations

import collections

import jax
import pytest

from metrale_jax import LLM, SamplingParams
from metrale_jax.default_model import model as default_model
from pallas_kernels.backend import CPU, XLA, KernelOps, resolve
from pallas_kernels.paged_attention import kernel as attn_kernel
from pallas_kernels.ssm_scan import kernel as ssd_kernel

ENGINE = dict(max_batch_size=2, max_tokens_per_tick=16, max_seq_len=64, block_size=8,
              num_kv_blocks=24, seq_buckets=(2,), token_buckets=(16,), query_buckets=(1, 16),
              block_buckets=(8,))
# One prompt spans two prefill chunks (the SSM scan continues from its slot), one is short.
PROMPTS = ["To be, or not to be, that is the question: whether tis nobler in the mind",
           "x"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_resolve():
    assert resolve("xla", "gpu") is XLA
    assert resolve("auto", "cpu") in (CPU, XLA)  # CPU once its library builds
    assert resolve("auto", "gpu") == KernelOps(use_pallas=True, interpret=False)
    assert resolve("pallas", "gpu") == KernelOps(use_pallas=True, interpret=False)
    assert resolve("pallas", "cpu") == KernelOps(use_pallas=True, interpret=True)
    assert hash(resolve("pallas", "cpu")) == hash(KernelOps(True, True))  # static-safe
    with pytest.raises(ValueError, match="kernel_backend"):
        resolve("triton")


def test_compiled_ops_fall_back_where_triton_tiles_do_not_fit():
    compiled, interpreted = KernelOps(True, False), KernelOps(True, True)
    assert compiled._kernel_fits(64, 128) and not compiled._kernel_fits(80)
    assert not compiled._kernel_fits(8) and interpreted._kernel_fits(8, 80)
    assert not XLA._kernel_fits(64)


def test_use_kernels_sets_every_mixer():
    model = default_model.build()
    expected = resolve("auto")
    assert model.use_kernels("auto") == expected
    mixers = [b.mixer for b in [*model.blocks, *model.mtp[0].blocks] if b.kind in "AM"]
    assert mixers and all(m.ops == expected for m in mixers)
    if jax.default_backend() == "cpu":
        assert expected is CPU  # attention through the custom call, the rest on references


def _greedy(kernel_backend: str) -> list[list[int]]:
    # No program store: a program stored by an earlier run would be called, not traced, and
    # the test counts the kernels the trace goes through.
    llm = LLM(**ENGINE, kernel_backend=kernel_backend, warmup=False, program_cache="none")
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def test_pallas_greedy_equals_xla(monkeypatch):
    if not hasattr(default_model, "WEIGHTS_DIR") or not default_model.WEIGHTS_DIR.is_dir():
        # No trained weights in this checkout: the same architecture, seeded.
        monkeypatch.setattr(default_model, "load_trained", lambda *a: default_model.build(),
                            raising=False)
    xla = _greedy("xla")
    assert all(len(t) == 4 for t in xla)
    traced = collections.Counter()  # kernel wrappers seen while tracing the engine's steps
    for module, name in ((attn_kernel, "paged_attention"), (attn_kernel, "write_kv_pages"),
                         (ssd_kernel, "ssd_chunk_scan"), (ssd_kernel, "ssm_decode_step")):
        def counted(*args, _f=getattr(module, name), _n=name, **kwargs):
            traced[_n] += 1
            return _f(*args, **kwargs)
        monkeypatch.setattr(module, name, counted)
    assert _greedy("pallas") == xla
    assert set(traced) == {"paged_attention", "write_kv_pages", "ssd_chunk_scan",
                           "ssm_decode_step"}
