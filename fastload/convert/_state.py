"""The destination's conversion state: what a run finds there, and what it leaves for a re-run.

A destination holds, besides the dataset itself (the shards, their indexes, ``fastload.json`` and
the skip report ``_fastload_skipped.jsonl``), the state of an unfinished conversion under
``_fastload_convert/``: ``plan.json`` (written before any shard; it names the plan by its hash)
and ``done/<shard>.json``, one record per committed shard. :func:`check_destination` decides
from these whether a run finds its dataset complete, resumes, starts afresh or must refuse (a
different dataset is there); :func:`valid_done` tells which shards a resumed run keeps.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

from fastload.convert._plan import ConversionPlan, ShardPlan
from fastload.convert._progress import plural
from fastload.convert._space import space_for
from fastload.convert.sources import Source
from fastload.errors import (
    DatasetExistsError,
    FastloadError,
    InvalidArgumentError,
    ManifestError,
    ObjectNotFoundError,
)
from fastload.formats import MANIFEST_NAME, Manifest
from fastload.formats._names import ShardNames
from fastload.formats.manifest import read_manifest
from fastload.storage import Store

__all__ = [
    "DONE_PREFIX",
    "PLAN_KEY",
    "SKIPPED_KEY",
    "STATE_PREFIX",
    "check_destination",
    "check_not_inside",
    "clear_state",
    "done_key",
    "interrupted_note",
    "json_bytes",
    "valid_done",
    "write_plan",
]

STATE_PREFIX = "_fastload_convert/"
PLAN_KEY = STATE_PREFIX + "plan.json"
DONE_PREFIX = STATE_PREFIX + "done/"
SKIPPED_KEY = "_fastload_skipped.jsonl"
_PLAN_VERSION = 1


def done_key(name: str) -> str:
    """The key of shard ``name``'s done record."""
    return f"{DONE_PREFIX}{name}.json"


def json_bytes(doc: Any) -> bytes:
    """``doc`` as the state objects store it: indented, sorted keys, UTF-8, a final newline."""
    return (json.dumps(doc, indent=1, sort_keys=True, ensure_ascii=False) + "\n").encode("utf-8")


def clear_state(store: Store) -> None:
    """Delete every state object (``_fastload_convert/...``)."""
    store.delete_many(store.list_keys(STATE_PREFIX))


def valid_done(store: Store, name: str, plan: str) -> dict[str, Any] | None:
    """The done record of shard ``name`` if it belongs to ``plan`` and its objects are intact."""
    try:
        record = json.loads(store.get(done_key(name)))
        if record.get("plan_sha256") != plan:
            return None
        info = record["info"]
        if store.size(info["key"]) != info["num_bytes"]:
            return None
        if info.get("index_key") and not store.exists(info["index_key"]):
            return None
    except (FastloadError, OSError, ValueError, KeyError, TypeError):
        return None
    result: dict[str, Any] = record
    return result


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


def check_destination(
    store: Store, plan: ConversionPlan, *, overwrite: bool, prefix: str
) -> Manifest | bool:
    """What the destination holds, for a run of ``plan``.

    Returns the manifest when the destination already holds exactly this dataset (the state
    objects are then deleted; nothing else is touched), else whether the run resumes an
    unfinished conversion of the same plan. With ``overwrite``, whatever was there is removed
    first (see :func:`_clear_destination`) and the run starts afresh.

    Raises:
        DatasetExistsError: Without ``overwrite``: a different dataset, the unfinished
            conversion of another plan, or shards named like ours that no plan accounts for.
    """
    old = _existing_manifest(store)
    if (
        isinstance(old, Manifest)
        and old.created_by.get("plan_sha256") == plan.sha256
        and not overwrite
    ):
        clear_state(store)
        return old
    try:
        plan_doc = json.loads(store.get(PLAN_KEY))
    except ObjectNotFoundError:
        plan_doc = None
    except ValueError:
        plan_doc = {}
    if overwrite:
        _clear_destination(store, old if isinstance(old, Manifest) else None, prefix)
        return False
    if old is not None:
        raise DatasetExistsError(
            f"{store.url} already holds a different dataset ({MANIFEST_NAME} was made from "
            "another source or with other options); pass overwrite=True (--overwrite) to "
            "replace it, or choose another destination"
        )
    if plan_doc is not None:
        if plan_doc.get("plan_sha256") != plan.sha256:
            raise DatasetExistsError(
                f"{store.url} holds an unfinished conversion of a different input or with "
                f"other options ({PLAN_KEY}); re-run that command to finish it, or pass "
                "overwrite=True (--overwrite) to start over"
            )
        return True
    pattern = _shard_pattern(prefix)
    clash = [m.key for m in store.list(f"{prefix}-") if pattern.match(m.key)]
    if clash:
        raise DatasetExistsError(
            f"{store.url} already holds shards such as {clash[0]!r} that no fastload "
            "conversion plan accounts for; pass overwrite=True (--overwrite) to replace "
            "them, or choose another destination or prefix"
        )
    return False


def write_plan(store: Store, plan: ConversionPlan) -> None:
    """Put ``plan.json``, which a re-run recognises its plan by (before any shard is written)."""
    doc = {
        "fastload_convert_plan": _PLAN_VERSION,
        "plan_sha256": plan.sha256,
        "source": plan.source,
        "options": plan.options,
        "num_samples": plan.num_samples,
        "num_shards": len(plan.shards),
        "est_bytes": plan.est_bytes,
    }
    with space_for(store, PLAN_KEY):
        store.put(PLAN_KEY, json_bytes(doc))


def interrupted_note(store: Store | None, shards: Sequence[ShardPlan] | None, phase: str) -> str:
    """How far an interrupted conversion got, and what to do about it."""
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


def check_not_inside(source: Source, dst: Store) -> None:
    """Refuse a local destination inside the local source directory (it would become input)."""
    src_root = getattr(source.store, "root", None)
    dst_root = getattr(dst, "root", None)
    if not isinstance(src_root, str) or not isinstance(dst_root, str) or source.keys is not None:
        return
    src_real, dst_real = os.path.realpath(src_root), os.path.realpath(dst_root)
    if dst_real == src_real or dst_real.startswith(src_real.rstrip(os.sep) + os.sep):
        raise InvalidArgumentError(
            f"the destination {dst.url} is inside the source {source.store.url}; the shards would "
            "become part of the input. Choose a destination outside the source directory"
        )
