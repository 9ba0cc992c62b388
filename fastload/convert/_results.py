"""What a conversion reports: :class:`ConvertResult`, and a :class:`SkippedItem` per item left out.

Also the result of a conversion that finds its dataset already complete
(:func:`result_from_manifest`) and the plan a dry run prints (:func:`print_dry_run`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from fastload.convert._plan import ShardPlan
from fastload.convert._progress import format_bytes, format_duration, plural
from fastload.convert._state import SKIPPED_KEY
from fastload.convert.sources import SOURCES, Source
from fastload.errors import ObjectNotFoundError
from fastload.formats import Manifest
from fastload.storage import Store

__all__ = [
    "ConvertResult",
    "SkippedItem",
    "add_source_facts",
    "print_dry_run",
    "result_from_manifest",
]


@dataclass(frozen=True)
class SkippedItem:
    """An input item left out: an item error under ``on_error="skip"``, or (under any
    ``on_error``) a path the walk of a source tree did not convert (a loop, a link not followed,
    a duplicate of a file converted under another path).

    Attributes:
        item: The item (``"cat/001.jpg"``, ``"data.jsonl:17"``, ``"train-000003.tar#12"``).
        reason: Why, as the error message said.
        shard: The shard it was planned for, or ``None`` when it was dropped while planning.
        duplicate_of: For a duplicate (the same file as one converted, reached by another path:
            a symbolic or hard link), the path converted instead; else ``None``.
    """

    item: str
    reason: str
    shard: str | None = None
    duplicate_of: str | None = None

    def to_json(self) -> dict[str, Any]:
        """The skip report's record: ``duplicate_of`` only for a duplicate."""
        out: dict[str, Any] = {"item": self.item, "reason": self.reason, "shard": self.shard}
        if self.duplicate_of is not None:
            out["duplicate_of"] = self.duplicate_of
        return out

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SkippedItem:
        """The item a skip report's record (or a done record's) describes."""
        return cls(doc["item"], doc["reason"], doc.get("shard"), doc.get("duplicate_of"))


@dataclass
class ConvertResult:
    """What :func:`convert` did.

    Attributes:
        url: The destination store URL (dataset root).
        format: Canonical format name.
        num_samples: Samples written (planned samples for a dry run).
        num_shards: Shards in the dataset.
        num_bytes: Bytes of shard objects written (estimated for a dry run).
        skipped: Items left out under ``on_error="skip"``, and what the walk of a tree left out
            whatever ``on_error`` says (loops, links not followed, duplicates: see
            :attr:`SkippedItem.duplicate_of`), in plan order.
        dropped: Samples the ``map_fn`` hook dropped (returned ``None``); not errors.
        elapsed: Wall-clock seconds.
        resumed_shards: Shards already complete from an earlier, interrupted run.
        dry_run: Nothing was written.
        plan_sha256: Identity of the plan (also in the manifest's ``created_by``).
        manifest: The manifest written (``None`` for a dry run).
        skipped_report: URL of the skip report, or ``None`` when nothing was skipped.
        shard_names: Shard keys, in dataset order.
        source_type: The source type used (detected or forced): ``imagefolder``, ``files``, ...
        num_classes: Classes in the dataset's metadata (``metadata.classes``: an image folder's
            class directories), or ``None`` when it lists none.
        ignored: Input objects that are not samples and not errors, such as the ``README.txt``
            of an image folder (named in ``warnings``).
        warnings: What the user should know about the input: how the source type was guessed
            when the guess may be wrong, files left out (printed unless ``quiet``).
        unchanged: The destination already held exactly this dataset; nothing was written.
    """

    url: str
    format: str
    num_samples: int
    num_shards: int
    num_bytes: int
    skipped: list[SkippedItem] = field(default_factory=list)
    dropped: int = 0
    elapsed: float = 0.0
    resumed_shards: int = 0
    dry_run: bool = False
    plan_sha256: str = ""
    manifest: Manifest | None = None
    skipped_report: str | None = None
    shard_names: list[str] = field(default_factory=list)
    source_type: str = ""
    num_classes: int | None = None
    ignored: int = 0
    warnings: list[str] = field(default_factory=list)
    unchanged: bool = False

    @classmethod
    def for_dataset(
        cls,
        store: Store,
        manifest: Manifest,
        *,
        plan_sha256: str,
        skipped: list[SkippedItem],
        elapsed: float,
        resumed_shards: int,
    ) -> ConvertResult:
        """The result of a conversion whose dataset, in ``store``, is ``manifest``."""
        return cls(
            url=store.url,
            format=manifest.format,
            num_samples=manifest.num_samples,
            num_shards=len(manifest.shards),
            num_bytes=manifest.num_bytes,
            skipped=skipped,
            dropped=int(manifest.created_by.get("dropped", 0)),
            elapsed=elapsed,
            resumed_shards=resumed_shards,
            plan_sha256=plan_sha256,
            manifest=manifest,
            skipped_report=store.child_url(SKIPPED_KEY) if skipped else None,
            shard_names=[s.name for s in manifest.shards],
        )

    def _what(self) -> str:
        """``12 samples (source imagefolder, 2 classes)``, and for a token dataset ``holding 9000
        tokens of 12 documents``."""
        classes = (
            "no class list"
            if self.num_classes is None
            else plural(self.num_classes, "class", "classes")
        )
        source = f"source {self.source_type}, " if self.source_type else ""
        text = f"{plural(self.num_samples, 'sample')} ({source}{classes})"
        tokens = self.manifest.metadata.get("tokens") if self.manifest is not None else None
        if isinstance(tokens, dict):  # a token dataset: its samples are blocks of ids
            text += (
                f" holding {plural(tokens['num_tokens'], 'token')} of "
                f"{plural(tokens['num_documents'], 'document')}"
            )
        return text

    def _skips(self, verb: str = "skipped") -> str:
        text = f"{verb} {plural(len(self.skipped), 'item')}"
        if self.skipped_report:
            text += f" (listed in {self.skipped_report})"
        duplicates = [s for s in self.skipped if s.duplicate_of is not None]
        if duplicates:
            text += (
                f", {plural(len(duplicates), 'duplicate')} of a file converted under another "
                f"path (such as {duplicates[0].item}, the same file as "
                f"{duplicates[0].duplicate_of})"
            )
        if self.ignored:
            text += f"; left out {plural(self.ignored, 'file')} that " + (
                "is not a sample" if self.ignored == 1 else "are not samples"
            )
        return text

    def summary(self) -> str:
        """One line: the source type and class count, samples, shards, bytes, skipped items,
        elapsed time (or that nothing was to do)."""
        shards = f"{plural(self.num_shards, f'{self.format} shard')}"
        if self.dry_run:
            return (
                f"dry run: would write {self._what()} into {shards} (about "
                f"{format_bytes(self.num_bytes)}) at {self.url}; {self._skips('would skip')}"
            )
        if self.unchanged:
            return (
                f"nothing to do: {self.url} already holds this dataset, {self._what()} in "
                f"{shards}, {format_bytes(self.num_bytes)}; {self._skips()}"
            )
        rate = self.num_bytes / self.elapsed / 1e6 if self.elapsed > 0 else 0.0
        text = (
            f"converted {self._what()} into {shards}, {format_bytes(self.num_bytes)}, in "
            f"{format_duration(self.elapsed)} ({rate:.1f} MB/s) at {self.url}"
        )
        if self.resumed_shards:
            text += (
                f"; {plural(self.resumed_shards, 'shard')} "
                f"{'was' if self.resumed_shards == 1 else 'were'} already done"
            )
        if self.dropped:
            text += f"; the map hook dropped {plural(self.dropped, 'sample')}"
        return text + "; " + self._skips()


def add_source_facts(result: ConvertResult, source: Source) -> None:
    """Fill in what the summary says about the source: its type, classes, files left out."""
    result.source_type = SOURCES.canonical(source.type_name)
    classes = source.metadata().get("classes")
    result.num_classes = len(classes) if isinstance(classes, list) else None
    result.ignored = len(source.ignored)
    result.warnings = list(source.warnings)


def result_from_manifest(
    store: Store, manifest: Manifest, digest: str, start: float, plan_skipped: list[SkippedItem]
) -> ConvertResult:
    """The result of a run that finds its dataset complete: what the skip report there lists
    (``plan_skipped`` if it cannot be read), every shard counted as resumed."""
    skipped: list[SkippedItem] = []
    try:
        for line in store.get(SKIPPED_KEY).decode("utf-8").splitlines():
            doc = json.loads(line)
            skipped.append(SkippedItem.from_json(doc))
    except (ObjectNotFoundError, ValueError, KeyError):
        skipped = list(plan_skipped)
    return ConvertResult.for_dataset(
        store,
        manifest,
        plan_sha256=digest,
        skipped=skipped,
        elapsed=time.monotonic() - start,
        resumed_shards=len(manifest.shards),
    )


def print_dry_run(
    stream: IO[str], source: Source, shards: Sequence[ShardPlan], result: ConvertResult
) -> None:
    """Print a dry run's plan: source, destination, the first shards and skipped items, the
    summary."""
    lines = [
        f"source: {source.store.url} ({source.type_name})",
        f"destination: {result.url} ({result.format})",
        f"samples: {result.num_samples}",
        f"shards: {result.num_shards} (about {format_bytes(result.num_bytes)} in all)",
    ]
    for shard in list(shards[:5]):
        lines.append(
            f"  {shard.name}: {plural(shard.num_samples, 'sample')}, "
            f"~{format_bytes(shard.est_bytes)}"
        )
    if len(shards) > 5:
        lines.append(f"  ... and {len(shards) - 5} more")
    for item in result.skipped[:20]:
        lines.append(f"would skip {item.item}: {item.reason}")
    if len(result.skipped) > 20:
        lines.append(f"... and {plural(len(result.skipped) - 20, 'more item')} would be skipped")
    lines.append(result.summary())
    stream.write("\n".join(lines) + "\n")
    stream.flush()
