"""Build of fastload's one native module (everything else is in pyproject.toml).

``fastload.loader.images._jpegroi`` decodes only the region of a JPEG that a crop needs, with
libjpeg-turbo's ``jpeg_crop_scanline``/``jpeg_skip_scanlines`` (see ``fastload/loader/images/_jpeg.py``).
It needs a C compiler and libjpeg-turbo's headers (Debian: ``libjpeg62-turbo-dev``, installed by
``tools/system-deps.sh``). It is optional: where it cannot be built, the install goes on and the
fused transforms decode whole images with simplejpeg (same pixels, ~16 % more decode time);
under ``CI=true`` the test suite fails instead of skipping its tests.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fastload.loader.images._jpegroi",
            sources=["fastload/loader/images/_jpegroi.c"],
            libraries=["jpeg"],
            optional=True,
        )
    ]
)
