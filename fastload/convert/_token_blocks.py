"""The token side of a shard job: records → text → ids → blocks written as samples.

A worker writing a shard of a tokenizing conversion hands each record to a :class:`TokenBlocks`
instead of writing it. It gathers the records' texts in batches (a few hundred documents, about
1 MB of text), encodes a batch at once (:class:`~fastload.convert._tokenizer.Encoder`), appends
each document's ids and the EOS id to the shard's stream, and writes every full block of the
stream as one sample (the layout of :mod:`fastload.formats.tokens`). Everything depends only on
the shard's records, so the bytes do not depend on the number of workers.

:func:`token_metadata` builds the manifest's ``metadata["tokens"]`` from the shards' done
records, which carry each shard's counts (so a resumed run knows those of the shards an earlier
run finished). :func:`check_text_field` looks at the first record before anything is written.
"""

from __future__ import annotations

import difflib
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from fastload.convert._map import describe
from fastload.convert._plan import ConversionPlan
from fastload.convert._tokenizer import TokenizerSpec, encoder
from fastload.convert.sources import ConversionError, Source, Unit
from fastload.errors import InvalidArgumentError, ManifestError
from fastload.formats import KEY, MANIFEST_NAME, ShardInfo, ShardWriter
from fastload.formats.tokens import DOCS_FIELD, METADATA_KEY, TOKENS_FIELD, TokenLayout
from fastload.storage import Store

__all__ = ["TokenBlocks", "block_key", "check_text_field", "token_metadata"]

#: A batch is encoded when it holds this many documents or this many bytes of text.
_BATCH_DOCS = 512
_BATCH_BYTES = 1 << 20
#: ``fail(unit, reason, exc, remedy=...)``: the worker's item-error handler (raises under
#: ``on_error="raise"``, else records the item as skipped).
Fail = Callable[..., None]


def block_key(shard_index: int, block: int) -> str:
    """The key of block ``block`` of shard ``shard_index``: ``{shard:06d}-{block:09d}``, unique in
    the dataset and sorting in stream order."""
    return f"{shard_index:06d}-{block:09d}"


def _npy(array: npt.NDArray[Any]) -> bytes:
    """``array`` (1-D, little-endian dtype) in ``.npy`` format version 1.0."""
    buf = io.BytesIO()
    np.lib.format.write_array(buf, array, version=(1, 0), allow_pickle=False)
    return buf.getvalue()


def _missing_field(field: str, sample: Mapping[str, Any]) -> str:
    fields = sorted(k for k in sample if not k.startswith("__"))
    close = difflib.get_close_matches(field, fields, n=3, cutoff=0.5)
    hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    return (
        f"the record has no text field {field!r} (--text-field); its fields are: "
        f"{', '.join(fields) or 'none'}{hint}"
    )


class TokenBlocks:
    """Tokenizes one shard's records and writes its blocks to ``writer``.

    Args:
        spec: The tokenizer and layout options.
        writer: The shard's writer.
        shard_index: The shard's number (the first part of the block keys).
        where: The shard's URL, for messages.
        fail: The worker's item-error handler, called for a record without the text field or
            whose text cannot be tokenized (such a record is left out).
    """

    def __init__(
        self, spec: TokenizerSpec, writer: ShardWriter, shard_index: int, where: str, fail: Fail
    ) -> None:
        self.spec = spec
        self._encoder = encoder(spec)
        self._dtype = self._encoder.dtype
        self._eos = np.array([spec.eos_id], dtype=self._dtype) if spec.eos_id is not None else None
        self._writer, self._shard, self._where, self._fail = writer, shard_index, where, fail
        self._batch: list[tuple[Unit, bytes]] = []
        self._batch_bytes = 0
        self._carry: npt.NDArray[Any] = np.empty(0, dtype=self._dtype)
        self._carry_starts: npt.NDArray[np.int64] = np.empty(0, dtype=np.int64)
        self.num_tokens = self.num_documents = self.num_blocks = 0

    def add(self, unit: Unit, sample: Mapping[str, Any]) -> None:
        """Take one record (a sample read from the source); full blocks are written as they
        fill."""
        text = sample.get(self.spec.text_field)
        if not isinstance(text, (bytes, bytearray, memoryview)):
            self._fail(
                unit,
                _missing_field(self.spec.text_field, sample),
                None,
                remedy="choose the field with --text-field (text_field=)",
            )
            return
        self._batch.append((unit, bytes(text)))
        self._batch_bytes += len(text)
        if len(self._batch) >= _BATCH_DOCS or self._batch_bytes >= _BATCH_BYTES:
            self._flush()

    def _flush(self) -> None:
        batch, self._batch, self._batch_bytes = self._batch, [], 0
        if not batch:
            return
        pieces: list[npt.NDArray[Any]] = [self._carry]
        starts: list[int] = []
        pos = len(self._carry)
        for (unit, _), ids in zip(batch, self._encoder.encode([t for _, t in batch]), strict=True):
            if isinstance(ids, Exception):
                self._fail(unit, describe(ids), ids, remedy="fix the input or the tokenizer")
                continue
            if not len(ids):  # no text, no document
                continue
            starts.append(pos)
            pieces.append(ids)
            pos += len(ids)
            if self._eos is not None:
                pieces.append(self._eos)
                pos += 1
            self.num_documents += 1
        stream = np.concatenate(pieces) if len(pieces) > 1 else self._carry
        doc_starts = np.concatenate([self._carry_starts, np.asarray(starts, dtype=np.int64)])
        size = self.spec.block_tokens
        full = len(stream) // size
        for b in range(full):
            self._write(stream[b * size : (b + 1) * size], doc_starts, b * size)
        cut = full * size
        self._carry = stream[cut:].copy()
        self._carry_starts = doc_starts[doc_starts >= cut] - cut

    def _write(self, block: npt.NDArray[Any], doc_starts: npt.NDArray[np.int64], at: int) -> None:
        lo, hi = np.searchsorted(doc_starts, [at, at + len(block)])
        docs = (doc_starts[lo:hi] - at).astype("<u4")
        self._writer.write(
            {
                KEY: block_key(self._shard, self.num_blocks),
                TOKENS_FIELD: _npy(block),
                DOCS_FIELD: _npy(docs),
            }
        )
        self.num_blocks += 1
        self.num_tokens += len(block)

    def finish(self) -> dict[str, int]:
        """Write what is left (the shard's last, possibly short, block); return the shard's
        counts for its done record: ``num_tokens``, ``num_documents``, ``num_blocks``.

        Raises:
            ConversionError: The shard holds no token (every record planned for it was left
                out or empty): a token shard holds at least one.
        """
        self._flush()
        if len(self._carry):
            self._write(self._carry, self._carry_starts, 0)
            self._carry = self._carry[:0]
        if not self.num_tokens:
            raise ConversionError(
                f"shard {self._where} would hold no token: every record planned for it is empty "
                "or was left out; fix the input (or the text field), or use larger shards "
                "(--shard-size / --shard-samples) so that it gets some text"
            )
        return {
            "num_tokens": self.num_tokens,
            "num_documents": self.num_documents,
            "num_blocks": self.num_blocks,
        }


def token_metadata(
    store: Store,
    plan: ConversionPlan,
    records: Mapping[str, Mapping[str, Any]],
    infos: Sequence[ShardInfo],
    metadata: Mapping[str, Any],
) -> dict[str, Any]:
    """The manifest's metadata: the source's ``metadata`` with, for a tokenizing ``plan`` (its
    options hold ``"tokenize"``, the spec's identity), ``"tokens"`` made from the shards' done
    ``records`` (their counts) and checked against the shards' sample counts (``infos``).

    Without tokenizing, a source's ``"tokens"`` (a token dataset converted again) is kept only
    while it still describes the shards (the same blocks per shard), else left out.

    Raises:
        ManifestError: The counts disagree (a bug, never a partial manifest).
    """
    identity = plan.options.get("tokenize")
    shard_samples = [i.num_samples for i in infos]
    where = store.child_url(MANIFEST_NAME)
    if not isinstance(identity, Mapping):
        out = dict(metadata)
        if METADATA_KEY in out:
            try:
                TokenLayout.from_metadata(out, shard_samples=shard_samples, where=where)
                if plan.options.get("shuffle"):  # the blocks are out of stream order
                    del out[METADATA_KEY]
            except ManifestError:
                del out[METADATA_KEY]
        return out
    counts = [records[s.name]["tokens"] for s in plan.shards]
    layout = TokenLayout(
        vocab_size=int(identity["vocab_size"]),
        eos_id=identity["eos_id"],
        block_tokens=int(identity["block_tokens"]),
        num_tokens=sum(int(c["num_tokens"]) for c in counts),
        num_documents=sum(int(c["num_documents"]) for c in counts),
        shard_tokens=tuple(int(c["num_tokens"]) for c in counts),
        tokenizer={
            k: v for k, v in identity.items() if k not in ("vocab_size", "eos_id", "block_tokens")
        },
    )
    out = {**metadata, METADATA_KEY: layout.to_json()}
    TokenLayout.from_metadata(out, shard_samples=shard_samples, where=where)  # a self-check
    return out


def check_text_field(source: Source, units: Iterable[Unit], spec: TokenizerSpec) -> None:
    """Read the first record of the plan and check that it has the text field, so that a wrong
    ``--text-field`` fails before anything is written (a re-run with the right one is then not a
    different plan in the same destination).

    Raises:
        InvalidArgumentError: The first record has no such field (did-you-mean over its fields).
    """
    first = next(iter(units), None)
    if first is None:
        return
    for unit, result in source.read_units([first]):
        if isinstance(result, Exception) or spec.text_field in result:
            return
        raise InvalidArgumentError(
            f"cannot tokenize {unit.item}: {_missing_field(spec.text_field, result)}; choose "
            "the field with text_field= (--text-field)"
        )
