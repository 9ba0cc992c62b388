"""Images: decoding fields by extension, the transforms and the JPEG region decoder.

Public through :mod:`fastload.loader.decode` and :mod:`fastload.loader.transforms`; here live
the parts: the decoder (:mod:`._decode`; the webdataset ecosystem's extensions in
:mod:`._wds_codecs`), crop geometry (:mod:`._geometry`), the reduced-DCT JPEG
decode (:mod:`._jpeg`, and the native region decoder ``_jpegroi`` built by setup.py), resize
kernels (:mod:`._pixels`), the sample-dict dispatch (:mod:`._fields`), the transform classes
(:mod:`._transforms`) and :class:`~fastload.loader.transforms.Normalize` (:mod:`._normalize`).
"""
