"""What a grammar constraint costs per token, at batch 1 and 16, on the built-in model.

For each batch: delivered decode tokens/s of the same requests unconstrained, with the
pipeline on (the step runs ahead of the host) and off, and constrained by a regex that lets
every row decode the whole budget (the loop settles before each constrained step: the next
mask needs the token just sampled, so a constrained batch runs as the pipeline-off loop does,
plus the grammar's host work); and the host time per step spent in the grammar (masks
computed, tokens consumed). An unconstrained batch does no grammar work on the host (a device constant
stands in for the masks) and one traced `any` over the rows on the device.

With `--mtp` (results in structured_outputs_mtp.json): batch 1 constrained, MTP off and on
(the built-in model's two trained modules, gate on), for the regex above (the model fills it
with blanks its MTP modules rarely draft: drafts are cut on the host, the step verifies
none) and for one that admits the model's own text (`MTP_REGEX`: drafts pass the grammar and
are accepted); a constrained row checks its drafts against the grammar on the host (a mask
per position) and verifies those it allows. Steps are per request.
Run: `python -m benchmarks.structured_outputs`; results go to benchmarks/results/.
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import RESULTS, write_json, write_result
from metrale_jax.grammar.matcher import GrammarState
from metrale_jax.grammar.params import StructuredOutputsParams
from metrale_jax.request import SamplingParams

TOKENS = 48
PROMPT = 32
REGEX = r"[a-z ]{200,400}"  # never complete within TOKENS: every row decodes them all
MTP_REGEX = r"[A-Za-z ,.;:'!?\n]{200,400}"  # the built-in model's own text fits it


class GrammarClock:
    """Wall time inside GrammarState.next_mask, .check_drafts and .advance (patched for the
    run; a call inside another counts once)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved = {}
        self._depth = 0

    def __enter__(self):
        for name in ("next_mask", "check_drafts", "advance"):
            real = getattr(GrammarState, name)
            self._saved[name] = real

            def timed(*args, _real=real):
                t0 = time.perf_counter()
                self._depth += 1
                try:
                    return _real(*args)
                finally:
                    self._depth -= 1
                    if not self._depth:
                        self.seconds += time.perf_counter() - t0
            setattr(GrammarState, name, timed)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(GrammarState, name, real)


def run(batch: int, constrained: bool, repeats: int, pipeline: bool = True,
        mtp: bool = False, mtp_policy: str = "on", regex: str = REGEX) -> dict:
    from metrale_jax.engine import LLMEngine

    spec = {"method": "mtp", "num_speculative_tokens": 2, "gate": "on"} if mtp else None
    engine = LLMEngine(None, max_batch_size=batch, max_tokens_per_tick=max(64, batch * 4),
                       max_seq_len=128, block_size=16, num_kv_blocks=batch * 8 + 1,
                       seq_buckets=(batch,), token_buckets=(batch, max(64, batch * 4)),
                       query_buckets=(1, 64), block_buckets=(8,), enable_pipeline=pipeline,
                       speculative_config=spec)
    if mtp:
        engine.levers.set(mtp_policy=mtp_policy)
    so = StructuredOutputsParams(regex=regex) if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True,
                            structured_outputs=so)
    best, grammar_s, steps = None, 0.0, 0
    for rep in range(repeats + 1):  # the first round compiles
        reqs = [engine.make_request({"prompt_token_ids": [3 + (i * 7 + j) % 4000
                                                          for j in range(PROMPT)]}, params)
                for i in range(batch)]
        for r in reqs:
            engine.submit(r)
        while len(engine.core.active) < batch or engine.core.prefilling:
            engine.step()
        start_tokens = sum(len(s.output_ids) for r in reqs for s in r.sequences)
        start_steps = engine.core.steps_total
        with GrammarClock() as clock:
            t0 = time.perf_counter()
            while not all(r.finished for r in reqs):
                engine.step()
            engine.drain()
            elapsed = time.perf_counter() - t0
        tokens = sum(len(s.output_ids) for r in reqs for s in r.sequences) - start_tokens
        if rep and (best is None or tokens / elapsed > best):
            best = tokens / elapsed
            grammar_s = clock.seconds
            steps = engine.core.steps_total - start_steps
    counters = engine.core.tel.counters()
    engine.close()
    extra = {}
    if mtp:
        extra = {"mtp": mtp_policy, "regex": regex, "steps": steps, "acceptance_rate": round(
            counters.get("spec_decode_num_accepted_tokens", 0)
            / max(counters.get("spec_decode_num_draft_tokens", 0), 1), 3)}
    return {"batch": batch, "constrained": constrained, "pipeline": pipeline, **extra,
            "decode_tok_s": round(best, 1),
            "grammar_ms_per_step": round(1e3 * grammar_s / max(steps, 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mtp", action="store_true",
                        help="only batch 1 constrained with MTP off and on")
    args = parser.parse_args()
    if args.mtp:
        return main_mtp(args.repeats)
    rows = []
    for batch in (1, 16):
        plain = run(batch, False, args.repeats)
        settled = run(batch, False, args.repeats, pipeline=False)
        constrained = run(batch, True, args.repeats)
        for name, base in (("vs_unconstrained", plain), ("vs_pipeline_off", settled)):
            constrained[name] = round(constrained["decode_tok_s"] / base["decode_tok_s"], 3)
        rows += [plain, settled, constrained]
        print(plain, settled, constrained, flush=True)
    path = write_result("structured_outputs", {"regex": REGEX, "tokens": TOKENS,
                                               "prompt": PROMPT, "rows": rows})
    print(f"wrote {path}")


def main_mtp(repeats: int) -> None:
    rows = []
    for regex in (REGEX, MTP_REGEX):
        off = run(1, True, repeats, mtp=True, mtp_policy="off", regex=regex)
        on = run(1, True, repeats, mtp=True, regex=regex)
        on["vs_mtp_off"] = round(on["decode_tok_s"] / off["decode_tok_s"], 3)
        rows += [off, on]
        print(off, on, flush=True)
    path = write_json(RESULTS / "structured_outputs_mtp.json",
                      {"tokens": TOKENS, "prompt": PROMPT, "rows": rows},
                      "python -m benchmarks.structured_outputs --mtp --repeats "
                      f"{repeats}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
