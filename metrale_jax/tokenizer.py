"""Tokenizer wrapper for the engine: encode, decode, chat templates, streaming detokenization.

Why a wrapper and not ``transformers.AutoTokenizer``: the engine only needs the fast Rust
``tokenizers`` library plus a jinja2 chat template renderer, and importing transformers costs
seconds and pulls in a large dependency tree.  This module reads a Hugging Face model directory
(``tokenizer.json`` + optional ``tokenizer_config.json`` / ``chat_template.jinja``) directly and
reproduces the parts of transformers' behaviour that matter for serving.

No jax import here: tokenization runs on the host, in the server process.
"""

from __future__ import annotations

import json
import os
import pathlib
from datetime import datetime
from typing import Any, Iterable, Mapping, Sequence

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

__all__ = [
    "DEFAULT_CHAT_TEMPLATE",
    "IncrementalDetokenizer",
    "Tokenizer",
]

# ChatML: used when a model directory ships no chat template (also the built-in model's template).
DEFAULT_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

# Token names that commonly mean end-of-sequence; used only when no config names the EOS token.
_FALLBACK_EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")

# vLLM's choice: start streaming with a few prompt tokens as context, so decoders that strip a
# leading space at the start of a sequence (SentencePiece "▁") do not eat the first output space.
_PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT_CHAR = "\ufffd"


def _token_content(value: Any) -> str | None:
    """Special tokens in tokenizer_config.json are either a string or a serialized AddedToken dict."""
    if value is None:
        return None
    if isinstance(value, Mapping):
        return value.get("content")
    return str(value)


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return json.load(f)


def _select_chat_template(model_dir: pathlib.Path, config: Mapping[str, Any]) -> str:
    """Pick the chat template the way transformers does, falling back to ChatML.

    Newer HF exports put the template in ``chat_template.jinja``; older ones inline it in the
    config, sometimes as a list of named templates of which "default" is the chat one.
    """
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else DEFAULT_CHAT_TEMPLATE


class _GenerationTag(jinja2.ext.Extension):
    """Accept ``{% generation %}...{% endgeneration %}`` (used by some HF templates) as a no-op.

    transformers uses it to build assistant-token masks for training; for serving we only need
    the template to compile and render its body unchanged.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    """Templates call this to reject malformed conversations (e.g. roles out of order)."""
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """jinja's built-in tojson HTML-escapes; HF templates expect plain json.dumps output."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    """Compile in a sandbox: chat templates come from downloaded model repos, i.e. untrusted code.

    Environment options mirror transformers (trim_blocks/lstrip_blocks, loopcontrols, helpers),
    so renders match ``apply_chat_template(..., tokenize=False)`` byte for byte.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


class Tokenizer:
    """A Hugging Face tokenizer directory, served by the Rust ``tokenizers`` library."""

    def __init__(self, rust_tokenizer: _RustTokenizer, config: Mapping[str, Any] | None = None,
                 chat_template: str | None = None) -> None:
        self._tok = rust_tokenizer
        self.config: dict[str, Any] = dict(config or {})
        self.chat_template: str = chat_template or DEFAULT_CHAT_TEMPLATE
        self._template: jinja2.Template | None = None  # compiled lazily

        self.eos_token: str | None = _token_content(self.config.get("eos_token"))
        if self.eos_token is None and "eos_token" not in self.config:
            self.eos_token = self._guess_eos_token()
        self.bos_token: str | None = _token_content(self.config.get("bos_token"))
        self.pad_token: str | None = _token_content(self.config.get("pad_token"))
        self.unk_token: str | None = _token_content(self.config.get("unk_token"))

        self.eos_token_id: int | None = self._id_of(self.eos_token)
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        self.pad_token_id: int | None = self._id_of(self.pad_token)
        # Only prepend BOS ourselves when the config asks for it; post-processors that already
        # add it (Llama's TemplateProcessing) are detected in encode() to avoid doubling it.
        self._add_bos: bool = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None

    # ----------------------------------------------------------------------------- loading
    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> "Tokenizer":
        """Load ``tokenizer.json`` (required) and ``tokenizer_config.json`` (optional) from ``path``."""
        model_dir = pathlib.Path(path)
        tok_file = model_dir / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found at {tok_file} (expected a Hugging Face model directory "
                f"containing a fast-tokenizer file)"
            )
        config_file = model_dir / "tokenizer_config.json"
        config = _read_json(config_file) if config_file.is_file() else {}
        return cls(_RustTokenizer.from_file(str(tok_file)), config,
                   _select_chat_template(model_dir, config))

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def _guess_eos_token(self) -> str | None:
        """Without a config, take the first well-known EOS name that is a special token."""
        specials = {t.content for t in self._tok.get_added_tokens_decoder().values() if t.special}
        return next((name for name in _FALLBACK_EOS_NAMES if name in specials), None)

    # ----------------------------------------------------------------------------- properties
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of added tokens marked special, plus bos/eos/pad: what decode() skips by default."""
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids.update(i for i in (self.bos_token_id, self.eos_token_id, self.pad_token_id) if i is not None)
        return sorted(ids)

    @property
    def backend(self) -> _RustTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (for batch encoding and the like)."""
        return self._tok

    # ----------------------------------------------------------------------------- encode / decode
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text``; special-token strings inside ``text`` map to their ids (as HF).

        With ``add_special_tokens`` the tokenizer's own post-processor runs (it adds BOS for
        Llama-style models) and BOS is prepended if the config says ``add_bos_token`` and it is
        not already there.
        """
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._add_bos and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text for ``ids``; invalid or truncated UTF-8 decodes to U+FFFD (lossy, never raises)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ----------------------------------------------------------------------------- chat
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render a conversation to prompt text with the model's jinja chat template.

        Extra keyword arguments (``tools``, ``enable_thinking``, ...) are passed to the template,
        as transformers does.  Encode the result with ``add_special_tokens=False`` when the
        template already emits BOS itself.
        """
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables: dict[str, Any] = {
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            "unk_token": self.unk_token,
            "tools": None,
            "documents": None,
        }
        variables.update(kwargs)
        return self._template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **variables,
        )

    # ----------------------------------------------------------------------------- streaming
    def incremental(self, prompt_ids: Sequence[int] = (), skip_special_tokens: bool = True
                    ) -> "IncrementalDetokenizer":
        """A fresh streaming detokenizer for one request."""
        return IncrementalDetokenizer(self, prompt_ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, one request at a time.

    Decoding token by token is wrong for byte-level BPE (one character's bytes can span tokens)
    and for SentencePiece (spaces depend on neighbours), while decoding the whole sequence every
    step is O(n) per token.  Following vLLM, we decode only a window: ``prefix`` tokens whose text
    was already emitted (context) plus the tokens since, and emit the difference.  Text is held back
    while it ends in U+FFFD, i.e. while a multi-byte character is still incomplete.

    Invariant: ``"".join(push(t) for t in ids) + flush()`` equals the decode of the ids in context
    (``tok.decode(ids)`` when there is no prompt).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        # Only the window is kept; everything before _prefix has been emitted and is dropped.
        self._window: list[int] = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._read = len(self._window)  # window[:_read] is context whose text was already emitted
        self._prefix_text = self._decode(self._window)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one generated token; return the newly completed text (possibly "")."""
        self._window.append(int(token_id))
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            return ""  # nothing new yet, or a multi-byte character is still incomplete
        delta = text[len(self._prefix_text):]
        # Slide: the tokens just emitted become the context for the next step.
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta

    def flush(self) -> str:
        """Emit whatever is held back (call at end of stream).

        Needed only when the model stopped mid-character or produced text that really ends in
        U+FFFD; the held bytes then decode to replacement characters, as ``decode`` would.
        """
        text = self._decode(self._window)
        delta = text[len(self._prefix_text):] if len(text) > len(self._prefix_text) else ""
        self._window = self._window[self._read:]
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        return delta
