"""The destination's conversion state: what a run finds there, and what it leaves for a re-run.

A destination holds, besides the dataset itself (the shards, their indexes, ``fastload.json`` and
the skip report ``_fastload_skipped.jsonl``), the state of an unfinished conversion under
``_fastload_convert/``: ``plan.json`` (written before any shard; it names the source and options
by the hash of the plan's head) and ``done/<shard>.json``, one record per committed shard, naming
the shard's digest (the plan's hash up to and including it). :func:`check_destination` decides
from these whether a run resumes, starts afresh, must compare a whole plan first (a manifest, or
a version-1 state) or must refuse (a different dataset is there); as the streamed plan reaches
each shard, :func:`shards_to_write` keeps the shards done alike and refuses those done otherwise.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastload.convert._plan import ShardPlan
from fastload.convert._progress import plural
from fastload.convert._space import space_for
from fastload.errors import DatasetExistsError, FastloadError, ManifestError, ObjectNotFoundError
from fastload.formats import MANIFEST_NAME, Manifest, ShardNames
from fastload.formats.manifest import read_manifest
from fastload.storage import Store

__all__ = [
    "DONE_PREFIX",
    "PLAN_KEY",
    "SKIPPED_KEY",
    "STATE_PREFIX",
    "Found",
    "check_destination",
    "check_leftovers",
    "check_whole_plan",
    "clear_state",
    "done_key",
    "interrupted_note",
    "json_bytes",
    "shards_to_write",
    "valid_done",
    "write_plan",
]

_U = TypeVar("_U")

STATE_PREFIX = "_fastload_convert/"
PLAN_KEY = STATE_PREFIX + "plan.json"
DONE_PREFIX = STATE_PREFIX + "done/"
SKIPPED_KEY = "_fastload_skipped.jsonl"
#: Version 2: ``plan.json`` names the plan's head and done records their shard's digest (plans
#: stream); version 1 (read, never written) named the whole plan's hash in both.
_PLAN_VERSION = 2


def done_key(name: str) -> str:
    """The key of shard ``name``'s done record."""
    return f"{DONE_PREFIX}{name}.json"


def json_bytes(doc: Any) -> bytes:
    """``doc`` as the state objects store it: indented, sorted keys, UTF-8, a final newline."""
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def clear_state(store: Store) -> None:
    """Delete every state object (``_fastload_convert/...``)."""
    store.delete_many(store.list_keys(STATE_PREFIX))


def valid_done(
    store: Store, shard: ShardPlan, whole_plan: str | None = None
) -> dict[str, Any] | None:
    """The done record of ``shard`` if it records this shard of this plan and the shard's objects
    are intact; ``None`` when the shard must be written (no record, an unreadable one, or a shard
    or index object missing or of another size).

    A record written since plans stream names the shard's own digest (``shard_sha256``, the
    :class:`~fastload.convert._plan.PlanHash` of the plan up to and including it); one written
    before (version 1) names the whole plan's hash (``plan_sha256``), which a run resuming such
    a conversion passes as ``whole_plan`` once it has planned everything.

    Raises:
        DatasetExistsError: The record names another digest for this shard: the shard was written
            from other samples (or options) than the source gives now.
    """
    try:
        record = json.loads(store.get(done_key(shard.name)))
        digest, whole = record.get("shard_sha256"), record.get("plan_sha256")
    except (FastloadError, OSError, ValueError, AttributeError):
        return None
    if digest is not None and digest != shard.digest:
        raise _changed_since(store, shard.name)
    if digest is None and (whole_plan is None or whole != whole_plan):  # version 1
        return None
    try:
        info = record["info"]
        if store.size(info["key"]) != info["num_bytes"]:
            return None
        if info.get("index_key") and not store.exists(info["index_key"]):
            return None
    except (FastloadError, OSError, KeyError, TypeError):
        return None
    result: dict[str, Any] = record
    return result


def _changed_since(store: Store, name: str) -> DatasetExistsError:
    """The error of a resumed run whose source no longer gives what shard ``name`` was written
    from (or that an earlier run wrote a shard this plan does not have)."""
    return DatasetExistsError(
        f"{store.url} holds an unfinished conversion whose shard {name} was written from other "
        "samples than the source gives now (the source changed since that run); restore the "
        "source and re-run to finish it, or pass overwrite=True (--overwrite) to convert it "
        "afresh"
    )


def shards_to_write(
    store: Store,
    shards: Iterable[tuple[ShardPlan, _U]],
    found: Found,
    keep: Callable[[dict[str, Any]], None],
) -> Iterator[tuple[ShardPlan, _U]]:
    """The shards of ``shards`` (each with its units) that are not done yet, as they come; the
    done record of each shard kept goes to ``keep`` (see :func:`valid_done`).

    Raises:
        DatasetExistsError: A shard was recorded done with another digest than the plan's.
    """
    for shard, units in shards:
        if shard.name in found.done:
            record = valid_done(store, shard, found.whole_plan)
            if record is not None:
                keep(record)
                continue
        yield shard, units


def check_leftovers(store: Store, found: Found, shards: Sequence[ShardPlan]) -> None:
    """After the whole plan is cut: refuse done records of shards this plan does not have (an
    earlier run of the same options planned more shards: the source changed since).

    Raises:
        DatasetExistsError: Such a record exists.
    """
    names = {s.name for s in shards}
    extra = sorted(n for n in found.done if n not in names)
    if extra:
        raise _changed_since(store, extra[0])


_SHARD_RE_TEMPLATE = r"^{prefix}-[0-9]{{6}}\.(?:{exts})(?:\.idx)?$"


def _shard_pattern(prefix: str) -> re.Pattern[str]:
    """Names of shards (and their indexes) that a conversion with ``prefix`` writes, in any of
    the registered formats."""
    exts = "|".join(ShardNames.from_registry().extensions())
    return re.compile(_SHARD_RE_TEMPLATE.format(prefix=re.escape(prefix), exts=exts))


def _clear_destination(store: Store, old: Manifest | None, prefix: str) -> None:
    """Remove a previous dataset: manifest first (so it is never half-valid), then its shards and
    indexes, our-pattern shard objects, the skip report and conversion state."""
    store.delete_many([MANIFEST_NAME])
    keys: list[str] = []
    if old is not None:
        for entry in old.shards:
            keys.append(entry.name)
            if entry.index:
                keys.append(entry.index)
    pattern = _shard_pattern(prefix)
    keys.extend(m.key for m in store.list(f"{prefix}-") if pattern.match(m.key))
    keys.append(SKIPPED_KEY)
    keys.extend(store.list_keys(STATE_PREFIX))
    store.delete_many(sorted(set(keys)))


def _existing_manifest(store: Store) -> Manifest | bool | None:
    """The manifest at the root, ``None`` if there is none, ``False`` if it is unreadable."""
    if not store.exists(MANIFEST_NAME):
        return None
    try:
        return read_manifest(store)
    except ManifestError:
        return False


@dataclass(frozen=True)
class Found:
    """What :func:`check_destination` found in a destination.

    Attributes:
        manifest: A dataset's manifest, which names the whole plan's hash: the run plans
            everything first and is done when the hashes agree (else it is refused).
        resume: An unfinished conversion of the same source and options is there to resume.
        whole_plan: The whole plan's hash that an unfinished conversion recorded in a version-1
            ``plan.json`` (before plans streamed): the run plans everything first, and resumes
            only if its plan has this hash.
        done: The shards recorded done (by name); see :func:`valid_done` for which stay.
    """

    manifest: Manifest | None = None
    resume: bool = False
    whole_plan: str | None = None
    done: frozenset[str] = frozenset()

    @property
    def needs_whole_plan(self) -> bool:
        """Whether the run must plan everything before writing (see the attributes)."""
        return self.manifest is not None or self.whole_plan is not None


def check_destination(store: Store, head_sha256: str, *, overwrite: bool, prefix: str) -> Found:
    """What the destination holds, for a run whose plan's head (source and options) hashes to
    ``head_sha256``; called before any shard is written, once the first one is planned.

    With ``overwrite``, whatever was there is removed first (see :func:`_clear_destination`)
    and the run starts afresh. Otherwise a manifest, or an unfinished conversion recorded in a
    version-1 ``plan.json``, is returned for the caller to compare with the whole plan's hash; a
    version-2 ``plan.json`` must name the same head, and the run resumes it.

    Raises:
        DatasetExistsError: Without ``overwrite``: an unreadable manifest, the unfinished
            conversion of another source or other options, or shards named like ours that no
            plan accounts for.
    """
    old = _existing_manifest(store)
    try:
        plan_doc = json.loads(store.get(PLAN_KEY))
    except ObjectNotFoundError:
        plan_doc = None
    except ValueError:
        plan_doc = {}
    if overwrite:
        _clear_destination(store, old if isinstance(old, Manifest) else None, prefix)
        return Found()
    if old is False:
        raise _different_dataset(store)
    done = frozenset(
        key[len(DONE_PREFIX) : -len(".json")]
        for key in store.list_keys(DONE_PREFIX)
        if key.endswith(".json")
    )
    if isinstance(old, Manifest):
        return Found(manifest=old, done=done)
    if plan_doc is not None:
        version = plan_doc.get("fastload_convert_plan") if isinstance(plan_doc, dict) else None
        if version == 1 and isinstance(plan_doc.get("plan_sha256"), str):
            return Found(resume=True, whole_plan=plan_doc["plan_sha256"], done=done)
        if version != _PLAN_VERSION or plan_doc.get("plan_head_sha256") != head_sha256:
            raise _different_unfinished(store)
        return Found(resume=True, done=done)
    pattern = _shard_pattern(prefix)
    clash = [m.key for m in store.list(f"{prefix}-") if pattern.match(m.key)]
    if clash:
        raise DatasetExistsError(
            f"{store.url} already holds shards such as {clash[0]!r} that no fastload "
            "conversion plan accounts for; pass overwrite=True (--overwrite) to replace "
            "them, or choose another destination or prefix"
        )
    return Found(done=done)


def check_whole_plan(store: Store, found: Found, plan_sha256: str) -> Manifest | None:
    """Compare what the destination names by a whole plan's hash (:attr:`Found.needs_whole_plan`)
    with the run's whole plan, ``plan_sha256``. Returns the manifest when the destination already
    holds this dataset (its state objects are then deleted), ``None`` when the run resumes the
    version-1 conversion found.

    Raises:
        DatasetExistsError: The manifest or the version-1 ``plan.json`` names another plan.
    """
    if found.manifest is not None:
        if found.manifest.created_by.get("plan_sha256") != plan_sha256:
            raise _different_dataset(store)
        clear_state(store)
        return found.manifest
    if found.whole_plan != plan_sha256:
        raise _different_unfinished(store)
    return None


def _different_unfinished(store: Store) -> DatasetExistsError:
    return DatasetExistsError(
        f"{store.url} holds an unfinished conversion of a different input or with "
        f"other options ({PLAN_KEY}); re-run that command to finish it, or pass "
        "overwrite=True (--overwrite) to start over"
    )


def _different_dataset(store: Store) -> DatasetExistsError:
    return DatasetExistsError(
        f"{store.url} already holds a different dataset ({MANIFEST_NAME} was made from "
        "another source or with other options); pass overwrite=True (--overwrite) to "
        "replace it, or choose another destination"
    )


def write_plan(store: Store, head_sha256: str, source: Any, options: Any) -> None:
    """Put ``plan.json`` (before any shard is written), which names the plan's head (source and
    options); a re-run with another head is refused, one with the same head resumes and checks
    each done shard against its digest (:func:`valid_done`)."""
    doc = {
        "fastload_convert_plan": _PLAN_VERSION,
        "plan_head_sha256": head_sha256,
        "source": source,
        "options": options,
    }
    with space_for(store, PLAN_KEY):
        store.put(PLAN_KEY, json_bytes(doc))


def interrupted_note(
    store: Store | None, shards: Sequence[ShardPlan] | None, phase: str, complete: bool = True
) -> str:
    """How far an interrupted conversion got, and what to do about it. ``shards`` are those
    planned, all of them if ``complete``, else those cut so far (the plan streams)."""
    if shards is None or store is None:
        return (
            "interrupted while planning, before anything was written; re-run the same command "
            "to start again"
        )
    if phase == "finishing":
        return (
            "interrupted while finishing (every shard was written); re-run the same command to "
            "complete the dataset"
        )
    try:
        done_keys = set(store.list_keys(DONE_PREFIX))
    except (FastloadError, OSError):
        done_keys = set()
    done = [s for s in shards if done_key(s.name) in done_keys]
    samples = sum(s.num_samples for s in shards)
    if not complete:
        return (
            f"interrupted after {len(done)} of the {plural(len(shards), 'shard')} planned so far "
            f"({sum(s.num_samples for s in done)} of {plural(samples, 'sample')}; planning had "
            "not finished); re-run the same command to resume: the finished shards are kept"
        )
    if len(done) == len(shards):
        return (
            f"interrupted after writing every shard ({len(shards)} of {len(shards)}), before the "
            "manifest; re-run the same command to complete the dataset"
        )
    return (
        f"interrupted after {len(done)} of {plural(len(shards), 'shard')} "
        f"({sum(s.num_samples for s in done)} of {plural(samples, 'sample')}); re-run the same "
        "command to resume: the finished shards are kept"
    )
