"""Decoding samples by field extension: the public face of :mod:`fastload.loader.images._decode`.

:class:`Decoder` turns a raw sample (``{"__key__": str, field: bytes}``) into decoded values by
each field's extension (images to arrays, labels to ints, JSON, NumPy, text); the table of
extensions and what each becomes is in :mod:`fastload.loader.images._decode`.
"""

# The public names are the implementation's own list: one list, kept where the names are defined.
from fastload.loader.images._decode import *  # noqa: F403
from fastload.loader.images._decode import __all__ as __all__
