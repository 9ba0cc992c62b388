"""Token data: packed sequences from token datasets, and the loader that batches them.

The token-source contract (:mod:`._source`), one token dataset as a source (:mod:`._dataset`,
:func:`~fastload.loader.open_tokens`), its blocks as NumPy arrays (:mod:`._blocks`) and
:class:`~fastload.loader.TokenLoader` (:mod:`._loader`).
"""
