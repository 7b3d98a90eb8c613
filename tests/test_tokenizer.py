"""Tests for metrale_jax.tokenizer and the built-in tokenizer in metrale_jax.default_model."""

from __future__ import annotations

import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metrale_jax.default_model import ASSET_DIR
from metrale_jax.tokenizer import DEFAULT_CHAT_TEMPLATE, IncrementalDetokenizer, Tokenizer

CONFIG = json.loads((ASSET_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))

SAMPLES = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "def f(x):\n\treturn x ** 2\n",
    "Ünïcödé façade — “quotes” and ‘more’",
    "日本語のテキストと中文文本",
    "emoji 🎉👩‍👩‍👧 and flags 🇯🇵",
    "special <|im_start|>user\nhi<|im_end|> inline <|endoftext|>",
    "",
    "\x00\x01 control \r\n bytes",
]

MULTIBYTE = "naïve café 你好世界 🎉🚀 Ωμέγα 👩‍👩‍👧 end"

# Full unicode minus surrogates (not encodable as UTF-8, so not valid Python->Rust strings).
unicode_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=200)
emoji_cjk_text = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0x4E00, max_codepoint=0x9FFF),  # CJK
        st.characters(min_codepoint=0x1F300, max_codepoint=0x1FAFF),  # emoji
        st.sampled_from(list("abc xyz\n\u200d\ufe0féñ")),
    ),
    max_size=80,
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_dir(ASSET_DIR)


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(ASSET_DIR))


# ----------------------------------------------------------------------------- built-in tokenizer
def test_special_ids_and_vocab_size(tok: Tokenizer) -> None:
    assert tok.eos_token_id == 0
    assert tok.pad_token_id == 0
    assert tok.bos_token_id is None
    assert tok.vocab_size == CONFIG["vocab_size"] == 4096
    assert tok.all_special_ids == [0, 1, 2]
    assert tok.backend.token_to_id("<|im_start|>") == 1
    assert tok.backend.token_to_id("<|im_end|>") == 2


def test_asset_is_small() -> None:
    assert (ASSET_DIR / "tokenizer.json").stat().st_size < 300_000


def test_config_template_is_default_chatml() -> None:
    assert CONFIG["chat_template"] == DEFAULT_CHAT_TEMPLATE


@given(unicode_text)
@settings(max_examples=200, deadline=None)
def test_roundtrip_arbitrary_unicode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


@given(emoji_cjk_text)
@settings(max_examples=100, deadline=None)
def test_roundtrip_emoji_cjk(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_bpe_compresses_english(tok: Tokenizer) -> None:
    text = "The function returns the value of the expression in the current namespace."
    assert len(tok.encode(text)) < len(text.encode("utf-8")) / 2.5


def test_special_tokens_in_text(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_end|>b")
    assert 2 in ids
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "a<|im_end|>b"


def test_regeneration_is_deterministic(tmp_path) -> None:
    # The real corpus is a download, so regenerate from a tiny synthetic corpus: the same
    # texts must give byte-identical files, with the specials first and the committed
    # tokenizer_config.json being exactly what the script writes for the real vocabulary.
    from metrale_jax.default_model import make_tokenizer

    texts = [f"ROMEO:\nLine {i} of verse, the {i % 7}th; thou art {i * 13 % 97} fair.\n"
             for i in range(200)]
    for run in ("a", "b"):
        make_tokenizer.write(tmp_path / run, texts, vocab_size=300, trained_on="synthetic")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    small = Tokenizer.from_dir(tmp_path / "a")
    assert small.vocab_size == 300
    assert small.all_special_ids == [0, 1, 2] and small.eos_token_id == 0
    assert small.decode(small.encode("ROMEO: 你好 🎉")) == "ROMEO: 你好 🎉"
    assert make_tokenizer.tokenizer_config() == CONFIG


# ----------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("text", SAMPLES)
def test_encode_matches_transformers(tok: Tokenizer, hf_tok, text: str) -> None:
    ids = tok.encode(text)
    assert ids == hf_tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def test_hf_special_tokens_agree(tok: Tokenizer, hf_tok) -> None:
    assert hf_tok.eos_token_id == tok.eos_token_id
    assert hf_tok.pad_token_id == tok.pad_token_id
    assert hf_tok.bos_token_id == tok.bos_token_id
    assert len(hf_tok) == tok.vocab_size


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(tok: Tokenizer, hf_tok, add_generation_prompt: bool) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi! 你好 🎉"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Line one\nline two"},
    ]
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    expected_tail = "<|im_start|>assistant\n" if add_generation_prompt else "line two<|im_end|>\n"
    assert ours.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert ours.endswith(expected_tail)


# ----------------------------------------------------------------------------- incremental detok
def _stream(det: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [det.push(i) for i in ids]


def test_incremental_multibyte_split_across_tokens(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE)
    # Precondition that makes the test meaningful: some tokens are partial characters.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok.incremental(), ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    assert "" in pieces  # something was actually held back


@given(emoji_cjk_text)
@settings(max_examples=100, deadline=None)
def test_incremental_equals_decode_property(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    det = tok.incremental()
    pieces = _stream(det, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + det.flush() == tok.decode(ids)


def test_incremental_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi ✨"}]))
    out_ids = tok.encode(" Hi there ✨ 世界") + [tok.eos_token_id]
    det = IncrementalDetokenizer(tok, prompt)
    pieces = _stream(det, out_ids)
    assert "".join(pieces) == tok.decode(out_ids) == " Hi there ✨ 世界"
    assert not any("\ufffd" in p for p in pieces)


def test_incremental_keeps_special_tokens_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("a<|im_end|>b")
    det = tok.incremental(skip_special_tokens=False)
    assert "".join(_stream(det, ids)) == "a<|im_end|>b"


def test_incremental_window_stays_small(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE * 50)
    det = tok.incremental()
    longest = 0
    text = []
    for i in ids:
        text.append(det.push(i))
        longest = max(longest, len(det._window))
    assert "".join(text) == MULTIBYTE * 50
    assert longest <= 12  # bounded by the longest partial character, not the sequence length


def test_incremental_flush_truncated_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉")
    cut = ids[:-1]  # the emoji is split over several byte tokens; drop the last one
    assert tok.decode(cut).endswith("\ufffd")
    det = tok.incremental()
    pieces = _stream(det, cut)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + det.flush() == tok.decode(cut)
    assert det.flush() == ""


# ----------------------------------------------------------------------------- loading / configs
def test_missing_tokenizer_json_names_path(tmp_path) -> None:
    with pytest.raises(FileNotFoundError) as err:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(err.value)


def test_without_config_uses_defaults(tmp_path) -> None:
    shutil.copy(ASSET_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == 0  # guessed from the well-known "<|endoftext|>" special token
    assert tok.bos_token_id is None and tok.pad_token_id is None
    assert tok.chat_template == DEFAULT_CHAT_TEMPLATE
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == (
        "<|im_start|>user\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bos_added_once_when_configured(tmp_path) -> None:
    shutil.copy(ASSET_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    config = dict(CONFIG, bos_token={"content": "<|im_start|>", "special": True}, add_bos_token=True)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.bos_token_id == 1
    assert tok.encode("hi")[0] == 1
    assert tok.encode("<|im_start|>hi").count(1) == 1
    assert 1 not in tok.encode("hi", add_special_tokens=False)


def test_chat_template_file_and_helpers(tmp_path) -> None:
    shutil.copy(ASSET_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(CONFIG), encoding="utf-8")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}\n"
        "  {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}\n"
        "[{{ m['role'] }}]{{ m['content'] | tojson }}{{ eos_token }}\n"
        "{% endfor %}",
        encoding="utf-8",
    )
    tok = Tokenizer.from_dir(tmp_path)
    rendered = tok.apply_chat_template([{"role": "user", "content": "é<>"}], add_generation_prompt=False)
    assert rendered == '[user]"é<>"<|endoftext|>\n'  # trim/lstrip_blocks, unescaped tojson
    import jinja2

    with pytest.raises(jinja2.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_template_cannot_escape_sandbox(tmp_path) -> None:
    import jinja2.exceptions

    shutil.copy(ASSET_DIR / "tokenizer.json", tmp_path / "tokenizer.json")
    config = dict(CONFIG, chat_template="{{ messages.__class__.__mro__ }}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(jinja2.exceptions.SecurityError):
        Tokenizer.from_dir(tmp_path).apply_chat_template([])
