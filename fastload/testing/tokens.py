"""Token datasets for tests, written with the format writers as :mod:`fastload.formats.tokens`
specifies (for tests of the token loader and mixer that must not depend on a tokenizer).

:func:`write_token_dataset` lays out given documents (lists of ids) as the converter does: each
shard's stream is its documents' ids, each followed by ``eos_id`` (if any); the stream is cut into
blocks of ``block_tokens``; each block is one sample with ``tokens.npy`` and ``docs.npy``; the
manifest carries ``metadata["tokens"]``. It returns the dataset's whole token stream and the
positions where documents start, for tests to check what a loader delivers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from fastload.formats import Manifest, ShardEntry, ShardInfo, get_format, write_manifest
from fastload.formats.tokens import DOCS_FIELD, TOKENS_FIELD, TokenLayout
from fastload.storage import Store

__all__ = ["WrittenTokens", "write_token_dataset", "write_token_shards"]


@dataclass(frozen=True)
class WrittenTokens:
    """What :func:`write_token_dataset` wrote.

    Attributes:
        stream: The dataset's token stream (every shard's, in manifest order), ``int64``.
        doc_starts: Stream positions of every document's first id, increasing (documents
            without ids have none).
        layout: The manifest's token layout.
    """

    stream: npt.NDArray[np.int64]
    doc_starts: npt.NDArray[np.int64]
    layout: TokenLayout


def write_token_dataset(
    store: Store,
    documents: Sequence[Sequence[int]],
    *,
    shard_docs: Sequence[int] | None = None,
    block_tokens: int = 16,
    vocab_size: int = 1000,
    eos_id: int | None = 0,
    format_name: str = "webdataset",
    prefix: str = "",
) -> WrittenTokens:
    """Write ``documents`` as a token dataset at ``prefix`` of ``store``.

    Args:
        store: Where the dataset goes.
        documents: Each document's ids (each ``< vocab_size``; empty documents hold only EOS).
        shard_docs: Documents per shard, in order (sums to ``len(documents)``; every shard must
            end up with at least one id). ``None``: one shard.
        block_tokens: Ids per block.
        vocab_size: The vocabulary size (``<u2`` ids up to 65,536, else ``<u4``).
        eos_id: Appended after each document, or ``None``.
        format_name: Shard format name.
        prefix: Key prefix of the dataset root.
    """
    counts = list(shard_docs) if shard_docs is not None else [len(documents)]
    if sum(counts) != len(documents):
        raise ValueError(f"shard_docs {counts} does not sum to {len(documents)} documents")
    shards: list[tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]] = []
    done = 0
    for count in counts:
        ids: list[int] = []
        starts: list[int] = []
        for doc in documents[done : done + count]:
            begin = len(ids)
            ids.extend(int(t) for t in doc)
            if eos_id is not None:
                ids.append(eos_id)
            if len(ids) > begin:  # a document without ids (empty, no EOS) starts nowhere
                starts.append(begin)
        done += count
        shards.append((np.asarray(ids, dtype=np.int64), np.asarray(starts, dtype=np.int64)))
    return write_token_shards(
        store,
        shards,
        num_documents=len(documents),
        block_tokens=block_tokens,
        vocab_size=vocab_size,
        eos_id=eos_id,
        format_name=format_name,
        prefix=prefix,
    )


def write_token_shards(
    store: Store,
    shards: Sequence[tuple[npt.ArrayLike, npt.ArrayLike]],
    *,
    num_documents: int,
    block_tokens: int,
    vocab_size: int,
    eos_id: int | None,
    format_name: str = "webdataset",
    prefix: str = "",
) -> WrittenTokens:
    """Write each shard's stream (its ids, EOS ids included, and the increasing offsets of its
    documents' first ids) as a token dataset: vectorised, for corpora of millions of ids
    (benchmarks). Arguments as :func:`write_token_dataset`'s.
    """
    fmt = get_format(format_name)
    dtype = TokenLayout(vocab_size, eos_id, block_tokens, 0, 0, ()).dtype
    root = prefix.strip("/")
    entries: list[ShardEntry] = []
    infos: list[ShardInfo] = []
    streams: list[npt.NDArray[np.int64]] = []
    all_starts: list[npt.NDArray[np.int64]] = []
    offset = 0
    for s, (ids, starts) in enumerate(shards):
        stream = np.asarray(ids)
        doc_at = np.asarray(starts, dtype=np.int64)
        if not len(stream):
            raise ValueError(f"shard {s} would hold no ids")
        name = f"tokens-{s:06d}.{fmt.extension}"
        writer = fmt.writer(store, f"{root}/{name}" if root else name)
        try:
            bounds = np.searchsorted(doc_at, np.arange(0, len(stream) + block_tokens, block_tokens))
            for b, first in enumerate(range(0, len(stream), block_tokens)):
                inside = doc_at[bounds[b] : bounds[b + 1]] - first
                writer.write(
                    {
                        "__key__": f"{s:06d}-{b:08d}",
                        TOKENS_FIELD: stream[first : first + block_tokens].astype(dtype),
                        DOCS_FIELD: inside.astype("<u4"),
                    }
                )
            info = writer.close()
        except BaseException:
            writer.abort()
            raise
        infos.append(info)
        entries.append(ShardEntry.from_info(info, root))
        streams.append(stream.astype(np.int64))
        all_starts.append(doc_at + offset)
        offset += len(stream)
    layout = TokenLayout(
        vocab_size=vocab_size,
        eos_id=eos_id,
        block_tokens=block_tokens,
        num_tokens=offset,
        num_documents=num_documents,
        shard_tokens=tuple(len(x) for x in streams),
        tokenizer={"kind": "function", "name": "fastload.testing.tokens"},
    )
    manifest = Manifest(
        format=fmt.name,
        shards=entries,
        schema=Manifest.schema_from_fields(i.fields for i in infos),
        metadata={"tokens": layout.to_json()},
    )
    write_manifest(store, manifest, root)
    return WrittenTokens(np.concatenate(streams), np.concatenate(all_starts), layout)
