"""Training: the loss falls on learnable data, a checkpoint resumes bit-exactly, the data
order is a pure function of (seed, position), and the corpus cleaning does what it says."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from metrale_jax.config import ModelConfig
from metrale_jax.train.config import TrainConfig
from metrale_jax.train.corpus import clean
from metrale_jax.train.data import WindowSampler, eval_windows
from metrale_jax.train.trainer import Trainer

TINY = ModelConfig(
    vocab_size=32, hidden_size=32, layer_pattern="MFAF", num_heads=2, num_kv_heads=1,
    head_dim=16, intermediate_size=64, ssm_state_size=8, mamba_num_heads=2, mamba_head_dim=16,
    mamba_chunk_size=8, num_mtp_modules=2, tie_word_embeddings=True)
RUN = TrainConfig(batch_size=2, seq_len=16, steps=8, lr=1e-2, warmup_steps=2,
                  eval_every=100, eval_batches=2, checkpoint_every=100, block_size=8)


def _stream(n: int, seed: int) -> np.ndarray:
    """Learnable text: counting runs mod 32 from random starting points."""
    rng = np.random.default_rng(seed)
    parts = [(rng.integers(32) + np.arange(rng.integers(5, 40))) % 32 for _ in range(n)]
    return np.concatenate(parts).astype(np.int32)


TRAIN, VAL = _stream(300, 0), _stream(40, 1)


def _leaves(trainer: Trainer) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves((trainer.leaves, trainer.opt_state))]


def test_loss_falls() -> None:
    trainer = Trainer(TINY, RUN, TRAIN, VAL)
    before = trainer.evaluate()
    trainer.train(progress=False)
    after = trainer.evaluate()
    assert len(before.losses) == 1 + TINY.num_mtp_modules
    assert after.loss < before.loss - 0.5, (before.losses, after.losses)
    for depth in range(TINY.num_mtp_modules):
        assert after.losses[1 + depth] < before.losses[1 + depth], (before.losses, after.losses)
        assert 0.0 <= after.accept_true[depth] <= 1.0
        assert 0.0 <= after.accept_main[depth] <= 1.0


def test_resume_is_bit_identical(tmp_path) -> None:
    straight = Trainer(TINY, RUN, TRAIN, VAL)
    straight.train(progress=False)

    first = Trainer(TINY, RUN, TRAIN, VAL, tmp_path / "ckpt")
    first.train(until=RUN.steps // 2, progress=False)
    resumed = Trainer(TINY, RUN, TRAIN, VAL, tmp_path / "ckpt")
    assert resumed.restore()
    assert (resumed.step, resumed.position) == (RUN.steps // 2, RUN.steps // 2 * RUN.batch_size)
    resumed.train(progress=False)

    assert (resumed.step, resumed.position) == (straight.step, straight.position)
    for a, b in zip(_leaves(straight), _leaves(resumed), strict=True):
        np.testing.assert_array_equal(a, b)


def test_restore_without_checkpoint_is_false(tmp_path) -> None:
    assert not Trainer(TINY, RUN, TRAIN, VAL, tmp_path / "empty").restore()


def test_sampler_is_a_function_of_seed_and_position() -> None:
    window = RUN.window(TINY)
    a = WindowSampler(TRAIN, window, seed=3)
    b = WindowSampler(TRAIN, window, seed=3)
    later = a.batch(a.per_epoch + 5, 4)  # crosses into the second epoch first
    early = a.batch(0, 4)
    np.testing.assert_array_equal(early, b.batch(0, 4))
    np.testing.assert_array_equal(later, b.batch(b.per_epoch + 5, 4))
    assert early.shape == (4, window)
    assert not np.array_equal(early, WindowSampler(TRAIN, window, seed=4).batch(0, 4))
    # One epoch visits every window once, non-overlapping, from one random offset.
    ramp = WindowSampler(np.arange(1000, dtype=np.int32), 10, seed=0)
    firsts = np.sort([ramp.batch(p, 1)[0, 0] for p in range(ramp.per_epoch)])
    assert len(set(firsts)) == ramp.per_epoch
    np.testing.assert_array_equal(np.diff(firsts), 10)


def test_eval_windows_are_consecutive_and_fixed() -> None:
    stream = np.arange(100, dtype=np.int32)
    batches = eval_windows(stream, 10, 3)
    assert len(batches) == 3  # 9 whole windows in 99 usable tokens, batched by 3
    np.testing.assert_array_equal(batches[1][0], np.arange(30, 40))


def test_clean_strips_gutenberg_and_marks_speakers() -> None:
    raw = ("The Project Gutenberg EBook of X\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***"
           "\r\n\r\nACT I.\r\n\r\nScene I. A street.\r\n\r\nRomeo.\r\nIs the day so young?  \r\n"
           "\r\nFirst Citizen.\r\nBut new struck nine.\r\n\r\nEnd of the Project Gutenberg "
           "EBook of X\r\nlicence text\r\n")
    assert clean(raw) == ("ACT I.\n\nScene I. A street.\n\nROMEO:\nIs the day so young?\n\n"
                          "FIRST CITIZEN:\nBut new struck nine.\n")
    with pytest.raises(ValueError):
        TrainConfig(steps=0)
