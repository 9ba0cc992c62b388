"""``python -m fastload.cli``: the ``fastload`` command."""

from fastload.cli import run

run()
