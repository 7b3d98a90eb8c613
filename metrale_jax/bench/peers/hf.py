"""Hugging Face transformers (torch, CPU) as a peer: `generate` on the same checkpoint and
the same token-id prompts, greedy, every request forced to its full output length.

transformers batches statically: the requests go in waves of `concurrency`, each wave
left-padded to its longest prompt and run to its longest output; a wave's tokens beyond a
request's own output_len are work the engine did but are not counted.
"""

from __future__ import annotations

import time

from tqdm import tqdm

from metrale_jax.bench.datasets import BenchRequest
from metrale_jax.bench.metrics import OfflineResult


def load_model(checkpoint: str, threads: int | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    if threads:
        torch.set_num_threads(threads)
    # The checkpoint's own dtype, as ours loads it ("auto"): same weights, same dtype.
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype="auto")
    model.eval()
    return model


def _wave_inputs(wave: list[BenchRequest], pad_id: int):
    import torch

    width = max(r.input_len for r in wave)
    ids = torch.full((len(wave), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(wave), width), dtype=torch.long)
    for i, r in enumerate(wave):
        ids[i, width - r.input_len:] = torch.tensor(r.prompt_token_ids)
        mask[i, width - r.input_len:] = 1
    return ids, mask


def generate_wave(model, wave: list[BenchRequest]):
    """Greedy outputs [len(wave), longest output] for one left-padded wave."""
    import torch

    pad_id = model.config.pad_token_id
    pad_id = 0 if pad_id is None else pad_id
    ids, mask = _wave_inputs(wave, pad_id)
    n = max(r.output_len for r in wave)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n,
                             min_new_tokens=n, do_sample=False, pad_token_id=pad_id)
    return out[:, ids.shape[1]:]


def run_offline(checkpoint: str, requests: list[BenchRequest], concurrency: int, *,
                threads: int | None = None, progress: bool = True) -> OfflineResult:
    t0 = time.perf_counter()
    model = load_model(checkpoint, threads)
    generate_wave(model, [BenchRequest(requests[0].prompt_token_ids[:8], 2)])
    warm_s = time.perf_counter() - t0
    waves = [requests[i:i + concurrency] for i in range(0, len(requests), concurrency)]
    t0 = time.perf_counter()
    for wave in tqdm(waves, desc=f"transformers c={concurrency}", unit="wave",
                     disable=not progress, leave=False):
        generate_wave(model, wave)
    elapsed = time.perf_counter() - t0
    return OfflineResult(
        engine="transformers", concurrency=concurrency, requests=len(requests),
        input_tokens=sum(r.input_len for r in requests),
        output_tokens=sum(r.output_len for r in requests), elapsed_s=elapsed,
        compile_s=warm_s, extra={"batching": "static waves"})
