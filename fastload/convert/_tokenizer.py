"""Tokenizers for ``convert --tokenize``: what turns a document's text into token ids.

Three kinds (``TOKENIZER`` on the command line, :attr:`Tokenize.tokenizer` in Python):

* **A Hugging Face ``tokenizers`` JSON file** (a path to ``tokenizer.json``), loaded with
  ``tokenizers.Tokenizer`` (optional dependency: ``pip install 'fastload[tokens]'``); nothing is
  downloaded. Documents are encoded without the tokenizer's own special tokens
  (``add_special_tokens=False``); the vocabulary size is its largest id + 1, added tokens
  included. Identified by the file's SHA-256.
* **``module:function``** (or, in Python, a module-level callable, which must pickle):
  ``function(text)``
  takes a document as ``str`` and returns its ids (a list or 1-D integer array). The function
  declares the vocabulary size as an int attribute ``vocab_size`` (required) and may declare its
  EOS id as an int attribute ``eos_id``. Identified by its name only (like ``--map``): change
  its name, or use ``--overwrite``, when its output changes.
* **``byte``**: the text field's bytes as they are (UTF-8 for text) are the ids 0..255; EOS is
  256; the vocabulary size 257.

:func:`resolve_tokenizer` runs in the converting process: it loads and checks the tokenizer, finds
the EOS id and returns a :class:`TokenizerSpec`: small, picklable and JSON-able. Its
:meth:`TokenizerSpec.identity` is part of the plan's hash, so a re-run with another tokenizer,
EOS, block size or text field is refused rather than mixed. :func:`encoder` turns a spec back
into an :class:`Encoder` in a worker process (once per process).
"""

from __future__ import annotations

import difflib
import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload._units import check_int
from fastload.convert._map import describe, map_name, resolve_map
from fastload.convert.sources import ConversionError, sanitize_field_name
from fastload.errors import InvalidArgumentError
from fastload.formats.tokens import token_dtype

__all__ = [
    "BYTE_EOS",
    "BYTE_VOCAB",
    "DEFAULT_BLOCK_TOKENS",
    "EOS_CANDIDATES",
    "Encoder",
    "TokenFn",
    "Tokenize",
    "TokenizerSpec",
    "encoder",
    "resolve_tokenizer",
]

#: Ids per block (sample) unless ``block_tokens`` says otherwise: 8,192 ids, 16 KiB as uint16.
DEFAULT_BLOCK_TOKENS = 8192
#: The ``byte`` tokenizer's EOS id and vocabulary size.
BYTE_EOS = 256
BYTE_VOCAB = 257
#: Tokens taken as a tokenizer file's own end of sequence, in this order of preference, when
#: ``eos`` is not given.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "[SEP]")
#: Sources whose samples hold no text to tokenize.
_NO_TEXT_SOURCES = ("imagefolder",)

#: A tokenizer function: a document's text -> its ids (a list or 1-D integer array).
TokenFn = Callable[[str], Any]


@dataclass(frozen=True)
class Tokenize:
    """How ``fastload.convert(..., tokenize=...)`` turns text records into a token dataset
    (``fastload/convert/README.md``, "Token datasets"; the layout is
    :mod:`fastload.formats.tokens`).

    Attributes:
        tokenizer: A path to a Hugging Face ``tokenizers`` JSON file, ``"module:function"`` (or a
            picklable module-level callable), or ``"byte"`` (see :mod:`._tokenizer`).
        text_field: The record field holding a document's text (JSONL key, CSV/Parquet column,
            a shard's field). Default ``"text"``; a text source's documents are its lines.
        eos: The id appended after every document: a token (``"</s>"``) or an id of the
            tokenizer, ``"none"`` for no separator, or ``None`` for the tokenizer's own
            (:data:`EOS_CANDIDATES` for a file, the function's ``eos_id``, 256 for ``byte``).
        block_tokens: Ids per block, i.e. per sample (>= 1; default 8,192).
    """

    tokenizer: str | TokenFn
    text_field: str | None = None
    eos: int | str | None = None
    block_tokens: int = DEFAULT_BLOCK_TOKENS


@dataclass(frozen=True)
class TokenizerSpec:
    """A resolved tokenizer and the layout options: what a worker needs to tokenize a shard.

    Attributes:
        kind: ``"hf-json"``, ``"function"`` or ``"byte"``.
        vocab_size: Every id is below it.
        eos_id: The id after every document, or ``None``.
        eos_token: The EOS token's text when known.
        text_field: The field of a sample holding the text (sanitized like field names).
        block_tokens: Ids per block.
        path: ``hf-json``: the file's absolute path (not part of the identity).
        sha256: ``hf-json``: the file's SHA-256, checked again in the workers.
        function: ``function``: its ``module:function`` name.
        fn: ``function``: the callable itself when one was given (else found by name).
        search_dir: Where ``function``'s module is also looked for (the current directory).
    """

    kind: str
    vocab_size: int
    eos_id: int | None
    eos_token: str | None
    text_field: str
    block_tokens: int
    path: str | None = None
    sha256: str | None = None
    function: str | None = None
    fn: TokenFn | None = None
    search_dir: str | None = None

    def identity(self) -> dict[str, Any]:
        """What identifies the tokenizing (in the plan's hash and ``metadata.tokens.tokenizer``):
        kind, the file's name and SHA-256 or the function's name, vocabulary, EOS, text field
        and block size."""
        out: dict[str, Any] = {
            "kind": self.kind,
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "eos_token": self.eos_token,
            "text_field": self.text_field,
            "block_tokens": self.block_tokens,
        }
        if self.kind == "hf-json":
            out["file"] = os.path.basename(self.path or "")
            out["sha256"] = self.sha256
        if self.kind == "function":
            out["function"] = self.function
        return out

    @property
    def token_size(self) -> tuple[int, int]:
        """``(bytes per id, text bytes per id)`` for the shard-size estimate
        (:class:`~fastload.convert._plan.ShardLayout`): the dtype's size, and 1 text byte per
        id for ``byte``, else 4 (about what BPE vocabularies give on English text)."""
        return token_dtype(self.vocab_size).itemsize, 1 if self.kind == "byte" else 4


def _hf() -> Any:
    from fastload._plugins import require

    return require("tokenizers", extra="tokens", feature="--tokenize with a tokenizer file")


def resolve_tokenizer(
    tokenize: str | TokenFn | Tokenize, source_type: str, search_dir: str | None
) -> TokenizerSpec:
    """Load and check the tokenizer of ``tokenize`` in the converting process.

    Args:
        tokenize: A :class:`Tokenize`, or its ``tokenizer`` alone (defaults for the rest).
        source_type: The canonical source type (``jsonl``, ``text``, ...).
        search_dir: Where a ``module:function``'s module is also looked for.

    Raises:
        InvalidArgumentError: A source without text, a bad option, a tokenizer file that does not
            exist or does not load, a function without ``vocab_size``, no EOS found (the message
            says to pass ``--eos``), or ``tokenizers`` missing (with the install hint).
    """
    opts = tokenize if isinstance(tokenize, Tokenize) else Tokenize(tokenize)
    if source_type in _NO_TEXT_SOURCES:
        raise InvalidArgumentError(
            f"--tokenize needs a source with text (JSONL, text, CSV, Parquet or shards with a "
            f"text field), but the source is an {source_type} (images); point SRC at text, or "
            "force the type with --source-type"
        )
    block_tokens = check_int("block_tokens (--block-tokens)", opts.block_tokens, minimum=1)
    field = _text_field(opts.text_field, source_type)
    spec = opts.tokenizer
    if callable(spec) or (isinstance(spec, str) and ":" in spec and not os.path.exists(spec)):
        return _function_spec(spec, opts.eos, field, block_tokens, search_dir)
    if spec == "byte":
        eos = BYTE_EOS if opts.eos is None else _eos_id(opts.eos, BYTE_VOCAB, "byte")
        if eos not in (None, BYTE_EOS):
            raise InvalidArgumentError(
                f"eos (--eos) of the byte tokenizer is {BYTE_EOS} or 'none', got {opts.eos!r}"
            )
        return TokenizerSpec("byte", BYTE_VOCAB, eos, None, field, block_tokens)
    if not isinstance(spec, str) or not os.path.isfile(spec):
        raise InvalidArgumentError(
            f"tokenizer (--tokenize) {spec!r} is neither a tokenizer JSON file (no such file), "
            "'module:function' nor 'byte'"
        )
    return _file_spec(spec, opts.eos, field, block_tokens)


def _text_field(text_field: str | None, source_type: str) -> str:
    if source_type == "text":
        if text_field not in (None, "txt"):
            raise InvalidArgumentError(
                f"text_field (--text-field) {text_field!r} does not apply to a text source: its "
                "documents are its lines; leave the option out"
            )
        return "txt"
    if text_field is not None and (not isinstance(text_field, str) or not text_field):
        raise InvalidArgumentError(f"text_field (--text-field) must be a name, got {text_field!r}")
    return sanitize_field_name(text_field or "text")


def _eos_id(eos: int | str, vocab_size: int, where: str) -> int | None:
    """An explicit ``eos`` as an id (``None`` for ``"none"``); a token string gives -1 (the
    caller looks it up)."""
    if isinstance(eos, str):
        if eos.lower() == "none":
            return None
        if not eos.strip().isdigit():
            return -1
        eos = int(eos)
    return check_int(f"eos (--eos) of {where}", eos, minimum=0, maximum=vocab_size - 1)


def _file_spec(path: str, eos: int | str | None, field: str, block_tokens: int) -> TokenizerSpec:
    path = os.path.abspath(path)
    with open(path, "rb") as f:
        data = f.read()
    tok = _load_hf(data, path)
    vocab = tok.get_vocab(with_added_tokens=True)
    vocab_size = max(vocab.values(), default=-1) + 1
    if vocab_size < 1:
        raise InvalidArgumentError(f"tokenizer file {path} has an empty vocabulary")
    token: str | None = None
    if eos is None:
        token = next((t for t in EOS_CANDIDATES if t in vocab), None)
        if token is None:
            special = sorted(str(t) for t in _special_tokens(tok))
            raise InvalidArgumentError(
                f"tokenizer file {path} declares no end-of-sequence token (none of "
                f"{', '.join(EOS_CANDIDATES)}); pass --eos TOKEN or --eos ID"
                + (f" (its special tokens: {', '.join(special[:10])})" if special else "")
                + ", or --eos none to put nothing between documents"
            )
        eos_id: int | None = vocab[token]
    else:
        eos_id = _eos_id(eos, vocab_size, f"tokenizer file {path}")
        if eos_id == -1:
            token = str(eos)
            if token not in vocab:
                close = difflib.get_close_matches(token, list(_special_tokens(tok)) or vocab, n=3)
                hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
                raise InvalidArgumentError(
                    f"eos (--eos) {token!r} is not a token of the tokenizer file {path}{hint} "
                    "(or pass an id, or 'none')"
                )
            eos_id = vocab[token]
        elif eos_id is not None:
            token = tok.id_to_token(eos_id)
    token_dtype(vocab_size)
    return TokenizerSpec(
        "hf-json",
        vocab_size,
        eos_id,
        token,
        field,
        block_tokens,
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
    )


def _load_hf(data: bytes, path: str) -> Any:
    tokenizers = _hf()
    try:
        return tokenizers.Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:
        raise InvalidArgumentError(
            f"tokenizer file {path} cannot be loaded by tokenizers {tokenizers.__version__} "
            f"({describe(exc)}); pass a Hugging Face tokenizer.json"
        ) from exc


def _special_tokens(tok: Any) -> list[str]:
    decoder = getattr(tok, "get_added_tokens_decoder", None)
    if decoder is None:
        return []
    return [t.content for t in decoder().values() if getattr(t, "special", False)]


def _function_spec(
    spec: str | TokenFn,
    eos: int | str | None,
    field: str,
    block_tokens: int,
    search_dir: str | None,
) -> TokenizerSpec:
    fn = resolve_map(
        spec,  # type: ignore[arg-type]
        search_dir if isinstance(spec, str) else None,
        what="tokenizer function",
        takes="takes a document's text (str) and returns its token ids",
    )
    name = str(map_name(spec))  # type: ignore[arg-type]
    if callable(spec):
        try:
            pickle.dumps(spec)
        except Exception as exc:
            raise InvalidArgumentError(
                f"tokenizer function {name} cannot be sent to worker processes ({exc}); pass a "
                "module-level function, or its name as 'module:function'"
            ) from exc
    vocab = getattr(fn, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= 2**32:
        raise InvalidArgumentError(
            f"tokenizer function {name} must declare its vocabulary size as an int attribute "
            f"from 1 to 2**32 (`{name.rsplit(':', 1)[-1]}.vocab_size = 50257`), got {vocab!r}"
        )
    if eos is None:
        declared = getattr(fn, "eos_id", None)
        if declared is None:
            raise InvalidArgumentError(
                f"tokenizer function {name} declares no eos_id attribute; pass --eos ID, or "
                "--eos none to put nothing between documents"
            )
        eos_id = _eos_id(declared, vocab, f"tokenizer function {name} (its eos_id)")
    else:
        eos_id = _eos_id(eos, vocab, f"tokenizer function {name}")
    if eos_id == -1:  # a token's text: a function has no vocabulary to look it up in
        raise InvalidArgumentError(
            f"eos (--eos) of tokenizer function {name} must be an id or 'none', got "
            f"{eos if eos is not None else getattr(fn, 'eos_id', None)!r}"
        )
    return TokenizerSpec(
        "function",
        vocab,
        eos_id,
        None,
        field,
        block_tokens,
        function=name,
        fn=spec if callable(spec) else None,
        search_dir=search_dir,
    )


class Encoder:
    """Encodes documents (a field's bytes) into ids, in a worker process. Not thread-safe."""

    def __init__(self, spec: TokenizerSpec) -> None:
        self.spec = spec
        self.dtype = token_dtype(spec.vocab_size)
        self._tok: Any = None
        self._fn: TokenFn | None = None
        if spec.kind == "hf-json":
            assert spec.path is not None
            with open(spec.path, "rb") as f:
                data = f.read()
            if hashlib.sha256(data).hexdigest() != spec.sha256:
                raise ConversionError(
                    f"the tokenizer file {spec.path} changed since the conversion was planned; "
                    "restore it, or re-run with overwrite=True (--overwrite) to convert afresh"
                )
            self._tok = _load_hf(data, spec.path)
            self._encode_batch = getattr(self._tok, "encode_batch_fast", self._tok.encode_batch)
        elif spec.kind == "function":
            found: Any = spec.fn or resolve_map(
                spec.function, spec.search_dir, what="tokenizer function"
            )
            self._fn = found

    def encode(self, docs: Sequence[bytes]) -> list[npt.NDArray[Any] | Exception]:
        """The ids of each document (in the spec's dtype), or the error that document gave."""
        if self.spec.kind == "byte":
            return [np.frombuffer(d, dtype=np.uint8).astype(self.dtype) for d in docs]
        out: list[npt.NDArray[Any] | Exception] = []
        texts: list[str] = []
        for d in docs:
            try:
                texts.append(d.decode("utf-8"))
                out.append(_PENDING)
            except UnicodeDecodeError as exc:
                out.append(ValueError(f"the text is not UTF-8 ({exc})"))
        if self._tok is not None:
            encoded = iter(self._encode_batch(texts, add_special_tokens=False))
            return [
                np.asarray(next(encoded).ids, dtype=self.dtype) if r is _PENDING else r for r in out
            ]
        pending = iter(texts)
        return [self._call(next(pending)) if r is _PENDING else r for r in out]

    def _call(self, text: str) -> npt.NDArray[Any] | Exception:
        assert self._fn is not None
        name = self.spec.function
        try:
            result = self._fn(text)
        except Exception as exc:
            return ValueError(f"the tokenizer function {name} raised {describe(exc)}")
        ids = np.asarray(result)
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            return ValueError(
                f"the tokenizer function {name} returned {type(result).__name__} of shape "
                f"{ids.shape} and dtype {ids.dtype}, not a 1-D list or array of int ids"
            )
        if ids.size:
            bad = np.flatnonzero((ids < 0) | (ids >= self.spec.vocab_size))
            if bad.size:
                return ValueError(
                    f"the tokenizer function {name} returned id {int(ids[bad[0]])} at position "
                    f"{int(bad[0])}, outside [0, {self.spec.vocab_size}) (its vocab_size)"
                )
        return ids.astype(self.dtype)


_PENDING = np.empty(0, dtype=np.uint8)
_ENCODERS: dict[str, Encoder] = {}


def encoder(spec: TokenizerSpec) -> Encoder:
    """The :class:`Encoder` of ``spec`` in this process (made once, then reused)."""
    key = repr((spec.identity(), spec.path, spec.fn))
    found = _ENCODERS.get(key)
    if found is None:
        found = _ENCODERS[key] = Encoder(spec)
    return found
