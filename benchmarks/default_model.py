"""The built-in model's quality on the held-out works, against two baselines.

Teacher-forced over every window of the validation split (`metrale_jax.train.corpus`
`VALIDATION_WORKS`), with the training geometry: the trained model's loss and perplexity per
head; the same for the untrained model (`default_model.build()`, the run's initialisation)
and for a unigram model (add-one token frequencies of the training split, scored on the same
targets); and each MTP depth's acceptance rate: how often its greedy draft equals the true
token, and equals the main model's greedy token for that position. Also a short greedy
sample. Run: `python -m benchmarks.default_model`.
"""

from __future__ import annotations

import json

import numpy as np

from benchmarks.common import write_result
from metrale_jax.default_model import ASSET_DIR
from metrale_jax.default_model import model as default_model
from metrale_jax.tokenizer import Tokenizer
from metrale_jax.train.config import TrainConfig
from metrale_jax.train.corpus import VALIDATION_WORKS, load_corpus
from metrale_jax.train.data import eval_windows, token_stream
from metrale_jax.train.step import Geometry, Steps, make_optimizer
from metrale_jax.train.trainer import evaluate


def unigram_loss(train: np.ndarray, batches: list[np.ndarray], vocab: int, seq_len: int,
                 ) -> float:
    counts = np.bincount(train, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = np.concatenate([b[:, 1:seq_len + 1].reshape(-1) for b in batches])
    return float(-logp[targets].mean())


def scores(ev) -> dict:
    return {"val_loss": ev.loss, "val_perplexity": ev.perplexity,
            "mtp_val_losses": ev.losses[1:]}


def main() -> None:
    cfg, run = default_model.CONFIG, TrainConfig()
    tokenizer = Tokenizer.from_dir(ASSET_DIR)
    corpus = load_corpus()
    train = token_stream(corpus.train.values(), tokenizer)
    val = token_stream(corpus.validation.values(), tokenizer)
    batches = eval_windows(val, run.window(cfg), run.batch_size)
    geom = Geometry(run.batch_size, run.seq_len, run.block_size)
    optimizer = make_optimizer(run.lr, run.warmup_steps, run.steps, run.min_lr_ratio,
                               run.weight_decay, run.grad_clip)

    trained_steps = Steps(default_model.load_trained(), geom, optimizer, run.mtp_weight)
    trained = evaluate(trained_steps, trained_steps.init_leaves, batches)
    untrained_steps = Steps(default_model.build(cfg, run.seed), geom, optimizer, run.mtp_weight)
    untrained = evaluate(untrained_steps, untrained_steps.init_leaves, batches)
    unigram = unigram_loss(train, batches, cfg.vocab_size, run.seq_len)

    from metrale_jax import LLM, SamplingParams

    llm = LLM()
    sample = llm.generate(["ROMEO:\n"], SamplingParams(max_tokens=80, temperature=0.0))[0]

    summary = json.loads((default_model.WEIGHTS_DIR / "train_summary.json").read_text()) \
        if (default_model.WEIGHTS_DIR / "train_summary.json").is_file() else {}
    payload = {
        "validation_works": list(VALIDATION_WORKS),
        "validation_tokens_scored": trained.tokens,
        "train_tokens": int(len(train)),
        "parameters": int(sum(x.size for x in trained_steps.init_leaves)),
        "trained": {**scores(trained),
                    "mtp_accept_true_token": trained.accept_true,
                    "mtp_accept_main_greedy": trained.accept_main},
        "untrained": scores(untrained),
        "unigram": {"val_loss": unigram, "val_perplexity": float(np.exp(unigram))},
        "training_steps": summary.get("step"),
        "greedy_sample_prompt": "ROMEO:\n",
        "greedy_sample": sample.outputs[0].text,
    }
    path = write_result("default_model", payload)
    print(json.dumps(payload, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
