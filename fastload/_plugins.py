"""One plugin mechanism for every kind of pluggable part (stores, formats).

A registry maps a name to a lazily imported ``"package.module:Attr"`` target plus the pip extra that
installs its dependencies. Third-party packages add entries through an entry-point group; code adds
them with :meth:`PluginRegistry.register`. Nothing is imported until a name is looked up.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from fastload.errors import InvalidArgumentError, MissingDependencyError

__all__ = ["PluginRegistry", "missing_dependency", "require"]


def missing_dependency(module: str, *, extra: str, feature: str) -> MissingDependencyError:
    """The error for an optional dependency that is not installed, with the fix (for code that
    imports the dependency with ``import`` statements and raises this from their ``ImportError``).

    Args:
        module: The module that is missing, e.g. ``"boto3"``.
        extra: The fastload extra that installs it, e.g. ``"s3"``.
        feature: What needs it, for the message, e.g. ``"the s3:// store"``.
    """
    return MissingDependencyError(
        f"{feature} needs the Python package {module!r}, which is not installed; "
        f"install it with: pip install 'fastload[{extra}]'"
    )


def require(module: str, *, extra: str, feature: str) -> Any:
    """Import an optional dependency or raise :class:`MissingDependencyError` with the fix.

    Args:
        module: The module to import, e.g. ``"boto3"``.
        extra: The fastload extra that installs it, e.g. ``"s3"``.
        feature: What needs it, for the message, e.g. ``"the s3:// store"``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise missing_dependency(module, extra=extra, feature=feature) from exc


@dataclass(frozen=True)
class _Entry:
    target: str | object  # "module:Attr" or the object itself
    extra: str | None = None  # the pip extra that installs what the plugin imports
    modules: tuple[str, ...] = ()  # third-party modules the plugin needs


class PluginRegistry:
    """Names to lazily imported objects, extended by an entry-point group.

    Args:
        kind: What the registry holds, for messages (``"store backend"``).
        group: The entry-point group third-party packages register under.
        unknown_hint: Appended to the unknown-name message.
    """

    def __init__(self, kind: str, group: str, unknown_hint: str = "") -> None:
        self.kind, self.group, self.unknown_hint = kind, group, unknown_hint
        self._entries: dict[str, _Entry] = {}
        self._aliases: dict[str, str] = {}
        self._loaded_entry_points = False

    def register(
        self,
        name: str,
        target: str | object,
        *,
        extra: str | None = None,
        modules: tuple[str, ...] = (),
        aliases: tuple[str, ...] = (),
    ) -> None:
        """Register (or replace) ``name``; ``target`` is an object or ``"module:Attr"``."""
        key = name.lower()
        self._entries[key] = _Entry(target, extra, modules)
        for alias in aliases:
            self._aliases[alias.lower()] = key

    def _load_entry_points(self) -> None:
        if self._loaded_entry_points:
            return
        self._loaded_entry_points = True
        for ep in entry_points(group=self.group):
            self._entries.setdefault(ep.name.lower(), _Entry(ep.value))

    def names(self) -> list[str]:
        """Registered names, sorted (aliases not included)."""
        self._load_entry_points()
        return sorted(self._entries)

    def canonical(self, name: str) -> str:
        """The registered name for ``name`` or one of its aliases.

        Raises:
            InvalidArgumentError: Unknown name; the message lists the known ones.
        """
        key = name.lower()
        key = self._aliases.get(key, key)
        if key in self._entries:  # built-in or registered: no need to scan entry points (~45 ms)
            return key
        self._load_entry_points()
        if key not in self._entries:
            import difflib

            hint = f" {self.unknown_hint}" if self.unknown_hint else ""
            close = difflib.get_close_matches(key, [*self._entries, *self._aliases], n=1)
            guess = f" did you mean {close[0]!r}?" if close else ""
            raise InvalidArgumentError(
                f"unknown {self.kind} {name!r};{guess} known: {', '.join(self.names())}.{hint}"
            )
        return key

    def load(self, name: str, error: type[InvalidArgumentError] = InvalidArgumentError) -> Any:
        """Import and return the object registered under ``name`` (or an alias).

        Raises:
            InvalidArgumentError: (or ``error``) for an unknown name.
            MissingDependencyError: The plugin's optional dependency is missing.
        """
        try:
            key = self.canonical(name)
        except InvalidArgumentError as exc:
            if error is InvalidArgumentError:
                raise
            raise error(str(exc)) from None
        entry = self._entries[key]
        for module in entry.modules:
            require(module, extra=entry.extra or module, feature=f"the {key} {self.kind}")
        if not isinstance(entry.target, str):
            return entry.target
        module_name, _, qualname = entry.target.partition(":")
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            hint = f"pip install 'fastload[{entry.extra}]'" if entry.extra else "reinstall fastload"
            raise MissingDependencyError(
                f"the {key} {self.kind} ({entry.target}) could not be imported ({exc}); "
                f"install it with: {hint}"
            ) from exc
        for part in qualname.split("."):
            obj = getattr(obj, part)
        return obj
