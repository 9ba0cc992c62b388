"""The map hook of ``convert``: a user's ``module:function`` run on every sample in the workers.

:func:`resolve_map` finds the function (in the converting process first, so that a bad name fails
before anything is written, then again in each worker); the helpers here make its failures say
what the user must fix: the missing module or attribute with close names, and the traceback of the
user's own code without fastload's or the import system's frames.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from fastload.errors import InvalidArgumentError

__all__ = ["MapFn", "describe", "map_name", "raised_where", "resolve_map", "user_traceback"]

MapFn = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def resolve_map(
    spec: str | MapFn | None,
    search_dir: str | None = None,
    *,
    what: str = "map function",
    takes: str = "takes a sample and returns a sample or None",
) -> MapFn | None:
    """The map function ``spec`` names (``"module:function"``), or ``spec`` if it is one.

    ``what`` and ``takes`` name the function's role in messages (the ``--tokenize`` function
    is found the same way: ``what="tokenizer function"``).

    ``search_dir`` (the directory the conversion was started from) is appended to ``sys.path``
    first, so that ``mymap.py`` there is found, like ``python -m`` finds it; appended, not
    prepended, so that a file there never shadows a module fastload itself imports.

    Raises:
        InvalidArgumentError: A malformed spec, no such module, no such function in it (the
            message lists the names it has), or an error while importing the module (the
            module's traceback is a note of the error).
    """
    if spec is None or callable(spec):
        return spec
    module_name, sep, qualname = spec.partition(":")
    if not sep or not module_name or not qualname:
        raise InvalidArgumentError(
            f"{what} {spec!r} must be written 'module:function' (an importable module and "
            f"a function in it that {takes})"
        )
    if search_dir and search_dir not in sys.path:
        sys.path.append(search_dir)
    module = _import_map_module(spec, module_name, search_dir, what)
    obj: Any = module
    for n, part in enumerate(qualname.split(".")):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            owner = module_name + "".join("." + p for p in qualname.split(".")[:n])
            raise InvalidArgumentError(
                f"cannot load {what} {spec!r}: {_describe_module(obj, owner)} has no "
                f"attribute {part!r}{_close_names(part, obj)}"
            ) from None
    if not callable(obj):
        raise InvalidArgumentError(f"{what} {spec!r} is a {type(obj).__name__}, not callable")
    result: MapFn = obj
    return result


def _import_map_module(spec: str, module_name: str, search_dir: str | None, what: str) -> Any:
    """Import the module of ``what`` ``spec``; tell a missing module from a failing one."""
    error: BaseException
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            here = f"the current directory ({search_dir}), " if search_dir else ""
            hint = ""
            if search_dir and "." not in module_name:
                hint = _close_files(module_name, search_dir)
            raise InvalidArgumentError(
                f"cannot load {what} {spec!r}: there is no module {missing!r}; it must be "
                f"a file {missing.replace('.', '/')}.py (or a package) in {here}a directory on "
                f"PYTHONPATH, or installed{hint}"
            ) from None
        error = exc
    except Exception as exc:  # the module's own code failed: SyntaxError, NameError, ...
        error = exc
    failure = InvalidArgumentError(
        f"cannot load {what} {spec!r}: importing module {module_name!r} raised "
        f"{describe(error)}; fix the module (its traceback is below)"
    )
    failure.add_note(user_traceback(error))
    raise failure from error


def _describe_module(obj: Any, name: str) -> str:
    """``module 'mymap' (/work/mymap.py)``: where an object whose attribute is missing came from,
    which tells an installed module from the user's file of the same name."""
    where = getattr(obj, "__file__", None)
    kind = "module" if isinstance(where, str) else type(obj).__name__
    return f"{kind} {name!r}" + (f" ({where})" if isinstance(where, str) else "")


def _close_names(name: str, obj: Any) -> str:
    """``; did you mean 'fn'? It has these functions and classes: boom, fn`` (``name`` missing)."""
    public = sorted(
        n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))
    )
    close = difflib.get_close_matches(name, public, n=3, cutoff=0.5)
    text = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
    lead = " It" if close else "; it"
    if public:
        text += f"{lead} has these functions and classes: {', '.join(public[:20])}"
        text += " ..." if len(public) > 20 else ""
    else:
        text += f"{lead} has no public function"
    return text


def _close_files(name: str, directory: str) -> str:
    try:
        stems = [f[:-3] for f in os.listdir(directory) if f.endswith(".py")]
    except OSError:
        return ""
    close = difflib.get_close_matches(name, stems, n=3, cutoff=0.5)
    return f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


#: Files of fastload itself and of the import system, left out of the tracebacks shown for a
#: user's map function and its module.
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_IMPORTLIB_DIR = os.path.dirname(os.path.abspath(importlib.__file__)) + os.sep


def _import_system(filename: str) -> bool:
    return filename.startswith(("<frozen importlib", _IMPORTLIB_DIR))


def user_traceback(exc: BaseException) -> str:
    """The traceback of ``exc`` from the first frame that is neither fastload's nor the import
    system's (the frames of the user's code, and whatever it called), without the import
    system's frames between modules importing each other."""
    frames = traceback.extract_tb(exc.__traceback__)
    first = 0
    while first < len(frames) and (
        frames[first].filename.startswith(_OWN_DIR) or _import_system(frames[first].filename)
    ):
        first += 1
    kept = [f for f in frames[first:] if not _import_system(f.filename)]
    lines = ["Traceback (most recent call last):\n"]
    lines += traceback.format_list(kept)
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip("\n")


def raised_where(exc: BaseException) -> str:
    """``/work/mymap.py:4, in boom``: where ``exc`` was raised."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return ""
    last = frames[-1]
    return f"{last.filename}:{last.lineno}, in {last.name}"


def map_name(spec: str | MapFn | None) -> str | None:
    if spec is None or isinstance(spec, str):
        return spec
    return f"{getattr(spec, '__module__', '?')}:{getattr(spec, '__qualname__', repr(spec))}"


def describe(exc: BaseException) -> str:
    """``ValueError: bad value`` (the type alone when the message is empty): an error as the
    messages about items name it."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
