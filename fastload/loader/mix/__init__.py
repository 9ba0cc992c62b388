"""Mixing datasets by weight, for samples and tokens alike.

:func:`~fastload.loader.mix` (:mod:`._open`) opens either kind; the arithmetic of a mix's windows
and positions is :mod:`._schedule`; :mod:`._samples` mixes sample datasets for
:class:`~fastload.DataLoader`, :mod:`._tokens` token sources for the token loader.
"""
