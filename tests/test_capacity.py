"""The capacity model (fastload._capacity) and ``fastload plan-capacity``."""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastload._capacity import PRESETS, Cluster, Workload, lru_downloads, plan_capacity
from fastload.cli import main
from fastload.errors import InvalidArgumentError

#: The dataset of tests/e2e/test_torchrun_nodes.py: 160 samples in 8 shards, 1,464,832 bytes of
#: tar and 10,902 of index.
SMALL = Workload(samples=160, sample_bytes=1_464_832 / 160, index_bytes_per_sample=10_902 / 160)
TORCHRUN = Cluster(
    gpus=4,
    samples_per_gpu=50,
    gpus_per_node=2,
    batch_size=2,
    workers=2,
    shard_bytes=1_464_832 // 8,
    cache_bytes=1_475_734 * 3 // 4,
    block_size=None,
    window=1,
    prefetch_shards=1,
)


def test_the_torchrun_run_as_the_model_sees_it() -> None:
    plan = plan_capacity(SMALL, TORCHRUN)
    assert (plan.nodes, plan.shards, plan.shard_samples) == (2, 8, 20)
    assert plan.node_read_fraction == 1.0  # a shard (20) is longer than a global step (8)
    assert plan.requests_per_shard == 4  # a head and a get for the shard and for its index
    assert plan.first_epoch_node_bytes == pytest.approx(1_475_734)
    assert plan.first_epoch_node_requests == pytest.approx(32)
    assert plan.cache_slots == 6  # 75 % of 8 shards with their indexes
    assert not plan.cache_holds
    assert 0.5 < plan.later_epoch_node_bytes / plan.node_footprint_bytes < 0.9


def test_a_cache_that_holds_the_footprint_downloads_nothing_later() -> None:
    plan = plan_capacity(SMALL, dataclasses.replace(TORCHRUN, cache_bytes=10**8))
    assert plan.cache_holds
    assert plan.later_epoch_node_bytes == plan.store_bandwidth_later == 0
    assert plan.node_hit_rate == 1.0


def test_the_block_shuffle_pays_for_eviction_with_repeated_downloads() -> None:
    tight = dataclasses.replace(TORCHRUN, block_size=5, window=1, cache_bytes=400_000)
    plan = plan_capacity(SMALL, tight)
    assert plan.visits_per_shard == 4
    assert plan.later_epoch_node_bytes > 2 * plan.node_footprint_bytes  # re-downloads
    roomy = plan_capacity(SMALL, dataclasses.replace(tight, cache_bytes=10**8))
    assert roomy.later_epoch_node_bytes == 0


def test_streaming_spreads_a_shard_over_few_nodes_and_blocks_over_all() -> None:
    work = PRESETS["imagenet"]
    base = Cluster(gpus=1000, samples_per_gpu=2500, cache_bytes=10**12)
    mixed = plan_capacity(work, base)
    assert mixed.node_read_fraction == pytest.approx(1.0)
    streaming = plan_capacity(work, dataclasses.replace(base, block_size=None, window=1))
    # A shard of ~2,300 samples meets ~2.1 runs of 2,048 (batch 256 x 8 GPUs) of the 125 nodes.
    runs = (streaming.shard_samples - 1) / 2048 + 1
    assert streaming.node_read_fraction == pytest.approx(runs / 125)
    assert streaming.first_epoch_node_bytes < mixed.first_epoch_node_bytes / 50


def test_rates_cpu_and_requests_follow_their_definitions() -> None:
    work = Workload(samples=10**6, sample_bytes=100_000, decode_cpu_ms=2.0, dali_cpu_ms=0.1)
    target = Cluster(gpus=16, samples_per_gpu=1000, shard_bytes=256_000_000, cache_bytes=10**12)
    plan = plan_capacity(work, target)
    assert plan.samples_per_s == 16_000
    assert plan.epoch_s == pytest.approx(62.5)
    assert plan.cpu_cores_per_gpu == pytest.approx(2.0)
    assert plan.dali_cores_per_gpu == pytest.approx(0.1)
    assert plan.requests_per_shard == 2  # a head and one streamed get, no index
    node_shards = plan.shards * plan.node_read_fraction
    assert plan.store_requests_first == pytest.approx(
        plan.nodes * node_shards * plan.requests_per_shard / plan.epoch_s
    )
    assert plan.store_bandwidth_first == pytest.approx(
        plan.nodes * plan.first_epoch_node_bytes / plan.epoch_s
    )


@pytest.mark.parametrize(
    ("field", "value"), [("gpus", 0), ("samples_per_gpu", 0.0), ("shard_bytes", -1)]
)
def test_bad_targets_are_refused(field: str, value: float) -> None:
    bad = dataclasses.replace(TORCHRUN, **{field: value})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=field):
        plan_capacity(SMALL, bad)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.integers(1, 300), st.integers(0, 300), st.integers(1, 5))
def test_lru_downloads_stay_within_their_bounds(
    shards: int, needed: int, slots: int, visits: int
) -> None:
    first, later = lru_downloads(shards, needed, slots, visits)
    assert 1.0 <= first <= visits  # each needed shard at least once, at most once per visit
    assert 0.0 <= later <= visits
    if slots >= shards:
        assert later == 0.0
    if slots == 0:
        assert first == later == visits


def test_a_shard_a_reader_keeps_open_is_not_downloaded_again() -> None:
    # One cache slot, each shard visited 4 times per epoch by one process.
    # (a visit right after one of the same shard hits).
    first, later = lru_downloads(8, 8, 1, 4)
    assert 3.0 < first < 4.0
    assert 3.0 < later < 4.0
    # The process keeps all 8 open: one download per shard and epoch, however small the cache
    # (the one slot may hold the next epoch's first shard).
    first, later = lru_downloads(8, 8, 1, 4, readers=1, open_shards=16)
    assert first == 1.0
    assert 0.9 < later <= 1.0
    # Spread over 4 processes, each holding 2 open: in between.
    first, later = lru_downloads(8, 8, 1, 4, readers=4, open_shards=2)
    assert 1.0 < later < 4.0


def test_the_command_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan-capacity", "--preset", "imagenet", "--gpus", "16", "--samples-per-gpu", "2000"]
    assert main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    expected = plan_capacity(PRESETS["imagenet"], Cluster(gpus=16, samples_per_gpu=2000))
    assert doc["plan"] == json.loads(json.dumps(expected.to_dict()))
    assert main([*args, "--block-size", "none", "--window", "2"]) == 0
    text = capsys.readouterr().out
    assert "streaming, window 2" in text
    assert "3.72 cores decoding on CPU" in text  # 2,000 samples/s x 1.86 ms


def test_the_command_refuses_what_it_cannot_plan(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan-capacity", "--gpus", "8", "--samples-per-gpu", "100"]) == 2
    assert "--samples and --sample-bytes" in capsys.readouterr().err
    args = ["plan-capacity", "--preset", "laion", "--gpus", "8", "--samples-per-gpu", "100"]
    with pytest.raises(SystemExit) as exit_info:  # a bad value, refused by argparse as any
        main([*args, "--block-size", "0"])
    assert exit_info.value.code == 2
    assert "--block-size: must be at least 1, got 0 (or 'none')" in capsys.readouterr().err


def test_an_impossible_target_is_flagged_with_the_time_the_epoch_takes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # README's example: ImageNet in 0.5 s on 1,000 GPUs needs 34.9 TB/s in the first epoch.
    target = Cluster(gpus=1000, samples_per_gpu=2500, cache_bytes=200 * 10**9)
    plan = plan_capacity(PRESETS["imagenet"], target)
    node_rate = plan.first_epoch_node_bytes / plan.epoch_s
    assert node_rate > target.node_bandwidth  # 279 GB/s per node against 12.5 GB/s
    assert len(plan.limits) == 3  # node network, store bandwidth, store requests; first epoch
    assert all(limit.startswith("the first epoch needs") for limit in plan.limits)
    seconds = plan.first_epoch_node_bytes / target.node_bandwidth
    assert f"at least {seconds:,.1f} s, not the 0.5 s" in plan.limits[0]
    assert "278.9 GB/s per node" in plan.limits[0]
    # A store that can serve it, and a network wide enough: nothing to flag.
    roomy = dataclasses.replace(
        target, node_bandwidth=1e12, store_bandwidth=1e14, store_requests=1e7
    )
    assert plan_capacity(PRESETS["imagenet"], roomy).limits == ()
    # One node streaming ImageNet at 8,000 samples/s (0.9 GB/s) fits every default ceiling.
    one_node = Cluster(gpus=8, samples_per_gpu=1000, block_size=None, window=1)
    assert plan_capacity(PRESETS["imagenet"], one_node).limits == ()
    args = ["plan-capacity", "--preset", "imagenet", "--gpus", "1000"]
    assert main([*args, "--samples-per-gpu", "2500", "--cache-size", "200GB"]) == 0
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("warning: ")]
    assert [w.removeprefix("warning: ") for w in warnings] == list(plan.limits)
    with pytest.raises(SystemExit) as refused:
        main([*args, "--samples-per-gpu", "2500", "--store-requests", "0"])
    assert refused.value.code == 2
    assert "--store-requests: must be at least 1" in capsys.readouterr().err


def test_scaling_md_holds_the_models_table() -> None:
    from pathlib import Path

    from benchmarks.scaling_tables import table

    text = (Path(__file__).parents[1] / "benchmarks" / "SCALING.md").read_text()
    assert table() in text, "benchmarks/SCALING.md: run python -m benchmarks.scaling_tables"
    # The figure README's example gives (544,426 requests/s) is the table's.
    assert "| 544,426, 0 |" in table()
