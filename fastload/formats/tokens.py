"""Token datasets: how blocks of token ids and document boundaries are laid out as samples.

A token dataset is an ordinary fastload dataset in any of the three formats, so every store, the
cache, ``fastload verify`` and ``fastload inspect`` work on it unchanged. What makes it a token
dataset is the layout of its samples and the ``"tokens"`` entry of the manifest's ``metadata``
(layout version :data:`TOKEN_LAYOUT_VERSION`):

* **The stream.** The converter tokenizes documents in source order and appends each document's
  ids followed by one end-of-sequence id (``eos_id``; none when the tokenizer has none). A shard
  holds whole documents (a document never spans two shards). The dataset's token stream is the
  concatenation of every shard's stream in manifest order.
* **Blocks.** Each shard's stream is cut into blocks of ``block_tokens`` ids; only the last block
  of a shard may be shorter (1 .. ``block_tokens`` ids; a shard holds at least one token). One
  block is one sample, in stream order within its shard.
* **Fields of a sample.** ``tokens.npy``: the block's ids, a 1-D C-order little-endian array
  (``<u2`` when ``vocab_size <= 65,536``, else ``<u4``) in NumPy's ``.npy`` format version 1.0
  (never pickled). ``docs.npy``: ``<u4``, the increasing offsets within the block at which a
  document's first token lies (empty when every token continues a document begun in an earlier
  block).
* **Manifest metadata** ``metadata["tokens"]``, see :class:`TokenLayout`.

Everything here is pure data: no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fastload.errors import ManifestError

__all__ = [
    "DOCS_FIELD",
    "METADATA_KEY",
    "TOKENS_FIELD",
    "TOKEN_LAYOUT_VERSION",
    "TokenLayout",
    "token_dtype",
]

#: Version of the layout described in this module (``metadata["tokens"]["layout"]``).
TOKEN_LAYOUT_VERSION = 1
#: The manifest ``metadata`` key that marks a token dataset.
METADATA_KEY = "tokens"
#: The field holding a block's token ids.
TOKENS_FIELD = "tokens.npy"
#: The field holding the offsets of document starts within a block.
DOCS_FIELD = "docs.npy"


def token_dtype(vocab_size: int) -> np.dtype[Any]:
    """The on-disk dtype for ids below ``vocab_size``: ``<u2`` up to 65,536, else ``<u4``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if vocab_size > 2**32:
        raise ValueError(f"vocab_size {vocab_size} does not fit 32-bit token ids")
    return np.dtype("<u2") if vocab_size <= 2**16 else np.dtype("<u4")


@dataclass(frozen=True)
class TokenLayout:
    """The ``metadata["tokens"]`` entry of a token dataset's manifest.

    Attributes:
        vocab_size: Every id is ``< vocab_size``.
        eos_id: The id appended after every document, or ``None``.
        block_tokens: Ids per block (sample); a shard's last block may be shorter.
        num_tokens: Ids in the whole dataset (EOS ids included).
        num_documents: Documents in the whole dataset.
        shard_tokens: Ids per shard, in manifest shard order (``sum == num_tokens``).
        tokenizer: How the ids were made (``{"kind": "hf-json" | "function" | "byte", ...}``,
            with what identifies it, e.g. a SHA-256 of a tokenizer file); informative.
        layout: The layout version (:data:`TOKEN_LAYOUT_VERSION`).
    """

    vocab_size: int
    eos_id: int | None
    block_tokens: int
    num_tokens: int
    num_documents: int
    shard_tokens: tuple[int, ...]
    tokenizer: Mapping[str, Any] = field(default_factory=dict)
    layout: int = TOKEN_LAYOUT_VERSION

    @property
    def dtype(self) -> np.dtype[Any]:
        """The ids' on-disk dtype (:func:`token_dtype` of :attr:`vocab_size`)."""
        return token_dtype(self.vocab_size)

    def shard_blocks(self) -> list[int]:
        """Blocks (samples) per shard: ``ceil(shard_tokens / block_tokens)``."""
        b = self.block_tokens
        return [-(-n // b) for n in self.shard_tokens]

    def to_json(self) -> dict[str, Any]:
        """The JSON object stored under ``metadata["tokens"]``."""
        return {
            "layout": self.layout,
            "dtype": self.dtype.str.lstrip("<|"),
            "vocab_size": self.vocab_size,
            "eos_id": self.eos_id,
            "block_tokens": self.block_tokens,
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "shard_tokens": list(self.shard_tokens),
            "tokenizer": dict(self.tokenizer),
        }

    @classmethod
    def from_metadata(
        cls,
        metadata: Mapping[str, Any],
        *,
        shard_samples: Sequence[int],
        where: str,
    ) -> TokenLayout:
        """Read and check ``metadata["tokens"]`` against the manifest's shard sample counts.

        Args:
            metadata: The manifest's ``metadata`` mapping.
            shard_samples: Samples per shard from the manifest, in order.
            where: The manifest's URL, for messages.

        Raises:
            ManifestError: Not a token dataset, a newer layout, or values that disagree with each
                other or with the shard list; the message names the manifest and the value.
        """
        entry = metadata.get(METADATA_KEY)
        if not isinstance(entry, Mapping):
            raise ManifestError(
                f"{where} is not a token dataset (no metadata[{METADATA_KEY!r}]); make one with "
                "`fastload convert SRC DST --tokenize TOKENIZER`"
            )

        def need_int(name: str, minimum: int) -> int:
            value = entry.get(name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ManifestError(
                    f"{where}: metadata.tokens.{name} must be an int >= {minimum}, got {value!r}; "
                    "re-create the dataset with `fastload convert --tokenize`"
                )
            return value

        layout = need_int("layout", 1)
        if layout > TOKEN_LAYOUT_VERSION:
            raise ManifestError(
                f"{where}: token layout version {layout} is newer than this fastload reads "
                f"({TOKEN_LAYOUT_VERSION}); upgrade fastload"
            )
        vocab_size = need_int("vocab_size", 1)
        block_tokens = need_int("block_tokens", 1)
        num_tokens = need_int("num_tokens", 0)
        num_documents = need_int("num_documents", 0)
        eos = entry.get("eos_id")
        if eos is not None and (
            isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab_size
        ):
            raise ManifestError(
                f"{where}: metadata.tokens.eos_id must be null or an int in [0, {vocab_size}), "
                f"got {eos!r}"
            )
        try:
            dtype = token_dtype(vocab_size)
        except ValueError as exc:
            raise ManifestError(f"{where}: metadata.tokens: {exc}") from None
        if entry.get("dtype", dtype.str.lstrip("<|")) != dtype.str.lstrip("<|"):
            raise ManifestError(
                f"{where}: metadata.tokens.dtype is {entry.get('dtype')!r}, but a vocabulary of "
                f"{vocab_size} is stored as {dtype.str.lstrip('<|')!r}"
            )
        raw_shards = entry.get("shard_tokens")
        if not isinstance(raw_shards, list) or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in raw_shards
        ):
            raise ManifestError(
                f"{where}: metadata.tokens.shard_tokens must be a list of positive ints"
            )
        if len(raw_shards) != len(shard_samples):
            raise ManifestError(
                f"{where}: metadata.tokens.shard_tokens lists {len(raw_shards)} shards, the "
                f"manifest {len(shard_samples)}"
            )
        if sum(raw_shards) != num_tokens:
            raise ManifestError(
                f"{where}: metadata.tokens.shard_tokens sums to {sum(raw_shards)}, but "
                f"num_tokens is {num_tokens}"
            )
        tokenizer = entry.get("tokenizer", {})
        out = cls(
            vocab_size=vocab_size,
            eos_id=eos,
            block_tokens=block_tokens,
            num_tokens=num_tokens,
            num_documents=num_documents,
            shard_tokens=tuple(raw_shards),
            tokenizer=dict(tokenizer) if isinstance(tokenizer, Mapping) else {},
            layout=layout,
        )
        for i, (blocks, samples) in enumerate(zip(out.shard_blocks(), shard_samples, strict=True)):
            if blocks != samples:
                raise ManifestError(
                    f"{where}: shard {i} holds {raw_shards[i]} tokens, which is {blocks} blocks "
                    f"of {block_tokens}, but the manifest lists {samples} samples for it"
                )
        return out
