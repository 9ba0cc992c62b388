"""fastload: fast, exactly-once, resumable data loading for deep-learning training."""

from fastload import errors
from fastload.storage import open_store

__version__ = "0.1.0"

__all__ = ["__version__", "errors", "open_store"]
