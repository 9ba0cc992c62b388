"""The fastload version, in a module of its own.

``fastload/__init__.py`` re-exports it as ``fastload.__version__``; code inside the package (the
manifests ``convert`` and ``index`` write, ``fastload --version``) imports it from here, so that it
never has to import the top-level package, which itself imports :mod:`fastload.convert`.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
