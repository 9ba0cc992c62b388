"""A bounded memo: the one way fastload keeps results it can make again.

:class:`BoundedMemo` maps keys to values it keeps least recently used last, within at most
``entries`` values and, where a ``weight`` is given, ``max_weight`` in total (bytes, usually).
Beyond either, the least recently used values go (an ``on_evict`` callback can close them). The
values must be things the caller could make again: dropping one costs time, never correctness.

No call raises when threads race on one memo (each step is one atomic dictionary operation
under the GIL, and a key another thread removed meanwhile is simply gone); the bounds and
:attr:`BoundedMemo.total_weight` are exact only when the owner serializes the calls (its lock).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

__all__ = ["BoundedMemo"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BoundedMemo(Generic[K, V]):
    """Values by key, least recently used first out beyond the bounds.

    Args:
        entries: The most values kept (>= 0; 0 keeps none).
        weight: The weight of a value (e.g. its ``nbytes``); ``None``: no weight bound.
        max_weight: The most total weight kept (with ``weight``).
        on_evict: Called with ``(key, value)`` for each value that the bounds push out (not for
            :meth:`pop`, replacements by :meth:`put` or :meth:`clear`).
    """

    def __init__(
        self,
        entries: int,
        *,
        weight: Callable[[V], int] | None = None,
        max_weight: int | None = None,
        on_evict: Callable[[K, V], None] | None = None,
    ) -> None:
        self.entries, self.max_weight = entries, max_weight
        self._weight, self._on_evict = weight, on_evict
        self._items: OrderedDict[K, V] = OrderedDict()
        self.total_weight = 0

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __iter__(self) -> Iterator[K]:
        return iter(self._items)

    def values(self) -> list[V]:
        """The values, least recently used first."""
        return list(self._items.values())

    def get(self, key: K) -> V | None:
        """The value of ``key`` (now the most recently used), or ``None``."""
        value = self._items.get(key)
        if value is not None:
            try:
                self._items.move_to_end(key)
            except KeyError:  # another thread dropped it meanwhile: still a valid answer
                pass
        return value

    def put(self, key: K, value: V) -> None:
        """Keep ``value`` under ``key`` (replacing what was there), then keep within the bounds."""
        self.pop(key)
        self._items[key] = value
        if self._weight is not None:
            self.total_weight += self._weight(value)
        self.trim()

    def get_or_make(self, key: K, make: Callable[[], V]) -> V:
        """The value of ``key``, made by ``make()`` and kept when there is none."""
        value = self.get(key)
        if value is None:
            value = make()
            self.put(key, value)
        return value

    def pop(self, key: K) -> V | None:
        """Forget ``key``; its value, or ``None``."""
        value = self._items.pop(key, None)
        if value is not None and self._weight is not None:
            self.total_weight -= self._weight(value)
        return value

    def clear(self) -> None:
        """Forget every value."""
        self._items.clear()
        self.total_weight = 0

    def limit(self, entries: int, max_weight: int | None = None) -> None:
        """Set new bounds and keep within them."""
        self.entries, self.max_weight = entries, max_weight
        self.trim()

    def trim(self) -> None:
        """Drop the least recently used values while over a bound."""
        items = self._items
        while items and (
            len(items) > self.entries
            or (self.max_weight is not None and self.total_weight > self.max_weight)
        ):
            try:
                key, value = items.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break
            if self._weight is not None:
                self.total_weight -= self._weight(value)
            if self._on_evict is not None:
                self._on_evict(key, value)
