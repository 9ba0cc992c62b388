"""Without DALI, ``import fastload.dali`` works and using it says how to install DALI."""

from __future__ import annotations

import sys

import pytest

from fastload.errors import MissingDependencyError


def test_missing_dali_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    for name in list(sys.modules):
        if name == "nvidia.dali" or name.startswith("nvidia.dali."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)  # makes `import nvidia.dali` fail
    import fastload.dali

    assert not fastload.dali.dali_available()
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[dali\]'"):
        fastload.dali.DALILoader(str(tmp_path), 4)
    with pytest.raises(MissingDependencyError, match=r"pip install 'fastload\[dali\]'"):
        fastload.dali.ImageAugment()(None, None, device="cpu")
