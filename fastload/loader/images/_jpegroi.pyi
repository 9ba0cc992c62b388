"""Types of the native region decoder (``_jpegroi.c``, built by setup.py)."""

JPEG_LIB_VERSION: int

def decode_region(
    data: bytes, scale_denom: int, top: int, left: int, height: int, width: int, /
) -> bytearray: ...
