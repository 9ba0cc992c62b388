"""What a sample goes through before collation: field selection (``to_tuple``) and the type of a
dataset's ``transform=``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from fastload.errors import InvalidArgumentError

__all__ = ["ToTuple", "Transform", "to_tuple"]


class ToTuple:
    """Select fields of a sample as a tuple: ``ToTuple("jpg;png", "cls")(sample)``.

    A field spec may list alternatives separated by ``;`` (the first present is taken), as in
    WebDataset's ``to_tuple``. Picklable, so it works with every multiprocessing start method.

    Args:
        *fields: Field names (or ``;``-separated alternatives), e.g. ``"jpg"``, ``"__key__"``.

    Raises:
        InvalidArgumentError: (when called) The sample has none of a spec's alternatives; the
            message names the sample key and the fields it has.
    """

    def __init__(self, *fields: str) -> None:
        if not fields:
            raise InvalidArgumentError("to_tuple needs at least one field name, e.g. 'jpg'")
        specs = []
        for spec in fields:
            if not isinstance(spec, str) or not spec or any(not p for p in spec.split(";")):
                raise InvalidArgumentError(
                    f"field specs are non-empty str like 'jpg' or 'jpg;png', got {spec!r}"
                )
            specs.append(tuple(spec.split(";")))
        self.fields: tuple[str, ...] = tuple(fields)
        self._specs = tuple(specs)

    def __call__(self, sample: Mapping[str, Any]) -> tuple[Any, ...]:
        out = []
        for alternatives in self._specs:
            for name in alternatives:
                if name in sample:
                    out.append(sample[name])
                    break
            else:
                have = sorted(k for k in sample if not k.startswith("__"))
                raise InvalidArgumentError(
                    f"sample {sample.get('__key__')!r} has none of the fields "
                    f"{';'.join(alternatives)!r} (it has {have}); fix the fields=... selection"
                )
        return tuple(out)

    def __repr__(self) -> str:
        return f"to_tuple({', '.join(repr(f) for f in self.fields)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ToTuple) and other.fields == self.fields

    def __hash__(self) -> int:
        return hash(self.fields)


def to_tuple(*fields: str) -> ToTuple:
    """A picklable callable returning the given fields of a sample as a tuple.

    ``to_tuple("jpg;png", "cls")`` turns ``{"__key__": "a", "jpg": img, "cls": 3}`` into
    ``(img, 3)``; see :class:`ToTuple`.
    """
    return ToTuple(*fields)


#: A per-field transform table or a whole-sample transform.
Transform = Callable[[Any], Any] | Mapping[str, Callable[[Any], Any]]
