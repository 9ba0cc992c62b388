"""Loaders checkpointed by ``torch.distributed.checkpoint`` (the ``Stateful`` protocol).

Training frameworks that save with DCP hand it the loader itself: DCP calls ``state_dict()`` at
save and ``load_state_dict()`` at load. The epoch must then continue exactly once, also with
another number of workers, for the sample loader and the token loader alike.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.stateful import Stateful

import fastload
from fastload.storage import LocalStore
from fastload.testing.tokens import write_token_dataset

pytestmark = [pytest.mark.timeout(300)]
SIZES = [7, 5, 11, 9]  # 32 samples: 8 batches of 4


def _dcp(action: Any, state: dict[str, Any], where: Path) -> None:
    with warnings.catch_warnings():  # no process group: DCP says it saves as one rank
        warnings.simplefilter("ignore", UserWarning)
        action(state, checkpoint_id=str(where))


@pytest.mark.parametrize("workers_after", [0, 2])
def test_the_data_loader_resumes_from_a_dcp_checkpoint(
    fake: SimpleNamespace, tmp_path: Path, workers_after: int
) -> None:
    root = fake.build_format_dataset(str(tmp_path / "ds"), SIZES)

    def loader(workers: int) -> fastload.DataLoader:
        ds = fastload.open_dataset(root, seed=3)
        return fastload.DataLoader(
            ds, batch_size=4, num_workers=workers, collate_fn=fake.keys_collate
        )

    whole = list(loader(0))
    first = loader(0)
    assert isinstance(first, Stateful)
    it = iter(first)
    head = [next(it) for _ in range(3)]
    _dcp(dcp.save, {"loader": first}, tmp_path / "ckpt")
    second = loader(workers_after)
    _dcp(dcp.load, {"loader": second}, tmp_path / "ckpt")
    tail = list(second)
    assert head + tail == whole
    assert sorted(k for batch in whole for k in batch) == sorted(fake.all_keys(SIZES))


def test_the_token_loader_resumes_from_a_dcp_checkpoint(tmp_path: Path) -> None:
    docs = [list(range(i * 50, i * 50 + 20 + i)) for i in range(30)]
    write_token_dataset(LocalStore(str(tmp_path / "tok")), docs, block_tokens=8)

    def loader() -> fastload.TokenLoader:
        return fastload.TokenLoader(fastload.open_tokens(str(tmp_path / "tok"), 16), 4)

    whole = [b["input_ids"].numpy() for b in loader()]
    first = loader()
    assert isinstance(first, Stateful)
    it = iter(first)
    head = [next(it)["input_ids"].numpy() for _ in range(2)]
    _dcp(dcp.save, {"tokens": first}, tmp_path / "ckpt")
    second = loader()
    _dcp(dcp.load, {"tokens": second}, tmp_path / "ckpt")
    tail = [b["input_ids"].numpy() for b in second]
    assert len(head) + len(tail) == len(whole) > 3
    for got, want in zip(head + tail, whole, strict=True):
        np.testing.assert_array_equal(got, want)
