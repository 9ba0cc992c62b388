"""The capacity model: what a training job asks of the store, the caches and the CPUs.

:func:`plan_capacity` turns measured per-sample costs (:class:`Workload`) and a target
(:class:`Cluster`) into a :class:`CapacityPlan`: the request rate and bandwidth the store must
serve (first epoch, and each epoch after it), each node's cache footprint and hit rate, CPU cores
per GPU for decoding on the CPU or with DALI, and the burst at the start of an epoch. ``fastload
plan-capacity`` prints it; ``benchmarks/SCALING.md`` validates it against the measured 2-node,
4-rank ``torchrun`` run and states it for 1,000 GPUs.

The model follows what fastload does, step by step:

* **Which shards a node reads.** Global step ``s`` covers ``G = batch x GPUs`` positions of the
  epoch order and a node's ranks take one run of ``L = batch x GPUs per node`` of them. With the
  block shuffle (``block_size`` set) a shard's ``S`` samples are spread over the whole epoch, so a
  node reads a shard unless none of its samples falls in the node's runs:
  ``P = 1 - (1 - 1/nodes)^S``. With the streaming shuffle (``block_size=None``, ``window=k``) a
  shard's samples stay within ``k x S`` consecutive positions, which meet
  ``min(nodes, (kS - 1)/L + 1)`` nodes' runs.
* **Cache fills.** A node downloads a shard (and its ``.idx``) once per visit that misses its cache.
  One fill is a ``head`` and one streamed ``get`` per object, whatever its size (S3 names the
  version it streams, so no second ``head``); a shard reader's own ``head`` is answered by the
  cache. The streaming shuffle
  visits a shard once per epoch, the block shuffle ``ceil(S / block_size)`` times, at random
  moments. A node that reads only part of the shards reads another random part each epoch. When
  the cache holds every shard the node will read, later epochs download nothing; otherwise the
  downloads of an epoch are those of an LRU cache of ``slots`` shards over the node's visits in a
  random order, computed by :func:`lru_downloads` (a seeded simulation; ``slots`` =
  budget / mean size of a shard with its index, to the nearest shard, less the shuffle window's
  other shards, read at the same time). A worker keeps ``max_open_shards`` shards open within an
  epoch, and an open shard is read again without the cache (even once evicted), so only a visit
  by a process that does not have the shard open counts.
* **CPU.** Cores per GPU = samples/s per GPU x CPU-ms per sample / 1000, with the per-sample cost
  of decoding on the CPU, or of the host's share of a DALI pipeline.
* **Epoch start.** Each of a node's ``GPUs per node x workers`` processes first builds a different
  global step and starts ``prefetch_shards`` fills ahead: the shards of the node's part of the first
  ``workers`` global steps plus the prefetches, all requested at once on every node.

Not modelled: retries, the manifest read (one ``get`` per rank at start-up), page-cache effects,
and stragglers; a cache directory shared with other datasets counts only this one.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections import OrderedDict
from typing import Any

from fastload._units import check_int, format_bytes
from fastload.errors import InvalidArgumentError

__all__ = [
    "PRESETS",
    "CapacityPlan",
    "Cluster",
    "Workload",
    "format_bytes",
    "lru_downloads",
    "plan_capacity",
]

#: Visits simulated at most by :func:`lru_downloads` (bigger footprints are scaled down).
MAX_SIMULATED_VISITS = 200_000


@dataclasses.dataclass(frozen=True)
class Workload:
    """Measured costs of one dataset.

    Attributes:
        samples: Samples in the dataset (> 0).
        sample_bytes: Mean bytes of one sample in its shard (tar members with headers, or
            records), > 0.
        index_bytes_per_sample: Bytes of the ``.idx`` per sample (0: no index files).
        decode_cpu_ms: CPU-milliseconds per sample to read, decode and augment on the CPU.
        dali_cpu_ms: CPU-milliseconds per sample left on the host when DALI decodes on the GPU
            (reading shards, feeding the pipeline).
    """

    samples: int
    sample_bytes: float
    index_bytes_per_sample: float = 0.0
    decode_cpu_ms: float = 0.0
    dali_cpu_ms: float = 0.0


#: Per-sample costs of two datasets (``fastload plan-capacity --preset``). CPU costs are those
#: measured in benchmarks/RESULTS.md on this project's 2-vCPU machine: the train path (decode at
#: reduced DCT scale + random-resized-crop 224 + flip) at its 2-core limit of 1,074 images/s
#: (1.86 CPU-ms per 500x375 JPEG of ~97 KB), and the bytes path (46 CPU-us per sample), which is
#: the host's share when DALI decodes. Index: 68 bytes per sample, measured on a converted
#: dataset (``jpg`` and ``cls``).
#: ``imagenet``: ImageNet-1k train, 1,281,167 JPEGs, ~110 KB each plus tar headers.
#: ``laion``: LAION-400M at 256 px, assumed ~25 KB per JPEG plus caption, JSON and headers, and
#: a decode cost scaled from the measured one by pixels (256x256 against 500x375: 0.35x).
PRESETS: dict[str, Workload] = {
    "imagenet": Workload(
        samples=1_281_167,
        sample_bytes=111_500,
        index_bytes_per_sample=68,
        decode_cpu_ms=1.86,
        dali_cpu_ms=0.046,
    ),
    "laion": Workload(
        samples=400_000_000,
        sample_bytes=27_000,
        index_bytes_per_sample=100,
        decode_cpu_ms=0.65,
        dali_cpu_ms=0.046,
    ),
}


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The target: the job and its data-loading options.

    Attributes:
        gpus: GPUs (ranks) in the job.
        samples_per_gpu: Samples per second each GPU trains on.
        gpus_per_node: Ranks per node (one cache directory per node).
        batch_size: Samples per rank per step.
        workers: DataLoader workers per rank.
        shard_bytes: Bytes per shard (the converter's ``--shard-size``).
        cache_bytes: Cache budget per node (``cache_size``).
        block_size: Shuffle block in samples; ``None`` = the streaming shuffle.
        window: Shuffle window (blocks, or shards for the streaming shuffle).
        prefetch_shards: Shards each worker keeps downloading ahead.
        max_open_shards: Shard readers each worker keeps open within an epoch (the loader's
            ``max_open_shards``); a shard it has open is read again without the cache.
        node_bandwidth: Bytes/s one node can download (the epoch-start burst, and a limit:
            :attr:`CapacityPlan.limits`).
        store_bandwidth: Bytes/s the store can serve the whole job. The default, 1 TB/s, is a
            plausible ceiling for a large Ceph or S3 deployment, not a measurement: give
            yours.
        store_requests: Requests/s the store can serve the whole job (default 100,000, as
            plausible a ceiling; an S3 bucket serves about 5,500 GETs/s per key prefix).
        seed: Seed of the LRU simulation.
    """

    gpus: int
    samples_per_gpu: float
    gpus_per_node: int = 8
    batch_size: int = 256
    workers: int = 8
    shard_bytes: int = 256_000_000
    cache_bytes: int = 10_000_000_000
    block_size: int | None = 64
    window: int = 64
    prefetch_shards: int = 2
    max_open_shards: int = 16
    node_bandwidth: float = 12.5e9
    store_bandwidth: float = 1e12
    store_requests: float = 100_000.0
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class CapacityPlan:
    """What :func:`plan_capacity` predicts. Bytes, seconds, requests; "per s" are rates.

    Attributes:
        nodes: Nodes (``ceil(gpus / gpus_per_node)``).
        samples_per_s: Samples per second over the job.
        epoch_s: Seconds per epoch.
        shard_samples: Samples per shard.
        shards: Shards in the dataset.
        dataset_bytes: Shards plus indexes.
        requests_per_shard: Store requests to fill one shard and its index.
        node_read_fraction: Fraction of the shards a node reads per epoch.
        visits_per_shard: Times a node reads a given shard per epoch (1: streaming shuffle).
        node_footprint_bytes: Bytes of the shards a node reads in one epoch.
        cache_slots: Shards (with index) the cache keeps besides those being filled.
        cache_holds: Later epochs download nothing (the cache keeps every shard the node
            reads: its footprint, or the whole dataset where the node reads another part of
            it each epoch).
        first_epoch_node_bytes: Bytes a node downloads in the first epoch (cold cache).
        later_epoch_node_bytes: Bytes a node downloads in each later epoch.
        first_epoch_node_requests: Store requests of a node in the first epoch.
        later_epoch_node_requests: Store requests of a node in each later epoch.
        node_hit_rate: Fraction of a node's shard visits served by its cache in later epochs.
        store_bandwidth_first: Bytes/s the store serves during the first epoch (all nodes).
        store_bandwidth_later: Bytes/s it serves during later epochs.
        store_requests_first: Requests/s during the first epoch.
        store_requests_later: Requests/s during later epochs.
        cpu_cores_per_gpu: Cores per GPU to decode on the CPU.
        dali_cores_per_gpu: Host cores per GPU with DALI decoding on the GPU.
        burst_node_shards: Shards a node requests at once at the start of an epoch.
        burst_bytes: Bytes requested at once over all nodes at the start of an epoch.
        burst_requests: Store requests at once over all nodes at the start of an epoch.
        burst_s: Seconds a node needs to download its burst at ``node_bandwidth``.
        limits: What makes the target impossible, one sentence each (empty when nothing
            does): an epoch that needs more than a node's network (``node_bandwidth``), the
            store's bandwidth or its request rate (``store_bandwidth``, ``store_requests``)
            can serve in ``epoch_s``, with the time that epoch takes at least.
    """

    nodes: int
    samples_per_s: float
    epoch_s: float
    shard_samples: int
    shards: int
    dataset_bytes: float
    requests_per_shard: int
    node_read_fraction: float
    visits_per_shard: int
    node_footprint_bytes: float
    cache_slots: int
    cache_holds: bool
    first_epoch_node_bytes: float
    later_epoch_node_bytes: float
    first_epoch_node_requests: float
    later_epoch_node_requests: float
    node_hit_rate: float
    store_bandwidth_first: float
    store_bandwidth_later: float
    store_requests_first: float
    store_requests_later: float
    cpu_cores_per_gpu: float
    dali_cores_per_gpu: float
    burst_node_shards: float
    burst_bytes: float
    burst_requests: float
    burst_s: float
    limits: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The plan as a JSON-ready dictionary (the attribute names)."""
        return dataclasses.asdict(self)


def _limits(
    target: Cluster, nodes: int, epoch_s: float, epochs: list[tuple[str, float, float]]
) -> tuple[str, ...]:
    """The sentences of :attr:`CapacityPlan.limits`; ``epochs`` holds (which epoch, a node's
    bytes, a node's requests)."""
    found = []
    for when, node_bytes, node_requests in epochs:
        needs = (
            (
                node_bytes / target.node_bandwidth,
                f"{format_bytes(node_bytes / epoch_s)}/s per node, more than its network "
                f"({format_bytes(target.node_bandwidth)}/s, --node-bandwidth)",
            ),
            (
                nodes * node_bytes / target.store_bandwidth,
                f"{format_bytes(nodes * node_bytes / epoch_s)}/s from the store, more than "
                f"{format_bytes(target.store_bandwidth)}/s (--store-bandwidth)",
            ),
            (
                nodes * node_requests / target.store_requests,
                f"{nodes * node_requests / epoch_s:,.0f} requests/s from the store, more than "
                f"{target.store_requests:,.0f}/s (--store-requests)",
            ),
        )
        for seconds, what in needs:
            if seconds > epoch_s:
                found.append(
                    f"{when} needs {what}: it takes at least {seconds:,.1f} s, not the "
                    f"{epoch_s:,.1f} s of the target ({seconds / epoch_s:,.1f}x)"
                )
    return tuple(found)


def _requests(nbytes: float) -> int:
    """Store requests of one cache fill of an object of ``nbytes`` bytes."""
    return 2 if nbytes > 0 else 0  # head, streamed get


def lru_downloads(
    shards: int,
    needed: int,
    slots: int,
    visits: int = 1,
    *,
    readers: int = 1,
    open_shards: int = 0,
    seed: int = 0,
) -> tuple[float, float]:
    """Downloads per needed shard of an LRU cache of ``slots`` shards over epochs in which a node
    reads a random ``needed`` of the ``shards`` shards (a new choice each epoch; all of them when
    ``needed == shards``), each ``visits`` times, in a random order: ``(first epoch, later
    epochs)``.

    Each visit is made by one of ``readers`` processes at random; a process keeps its last
    ``open_shards`` shards open (until the epoch ends) and reads them again without asking the
    cache, as shard readers do (an evicted shard that is still open stays readable).

    Footprints of more than :data:`MAX_SIMULATED_VISITS` visits are simulated at that scale with
    the same ratios; small ones are averaged over repeated runs. Deterministic for a ``seed``.
    """
    needed = min(needed, shards)
    if needed <= 0:
        return 0.0, 0.0
    if slots >= shards:
        return 1.0, 0.0
    scale = min(1.0, MAX_SIMULATED_VISITS / (max(needed, slots) * visits))
    n = max(1, round(shards * scale))
    k = max(1, min(n, round(needed * scale)))
    m = min(n - 1, round(slots * scale)) if slots > 0 else 0
    epochs = 2 + math.ceil(m / k)  # a cold epoch, enough to fill the cache, one measured
    trials = max(1, min(1000, MAX_SIMULATED_VISITS // (epochs * k * visits)))  # average small
    rng = random.Random(seed)
    first = later = 0
    for _ in range(trials):
        cache: OrderedDict[int, None] = OrderedDict()
        counts = []
        for _ in range(epochs):
            chosen = range(n) if k == n else rng.sample(range(n), k)
            sequence = [s for s in chosen for _ in range(visits)]
            rng.shuffle(sequence)
            opened: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(readers)]
            misses = 0
            for s in sequence:
                mine = opened[rng.randrange(readers)]
                if s in mine:
                    mine.move_to_end(s)
                    continue
                if open_shards:
                    mine[s] = None
                    if len(mine) > open_shards:
                        mine.popitem(last=False)
                if s in cache:
                    cache.move_to_end(s)
                    continue
                misses += 1
                if m:
                    cache[s] = None
                    if len(cache) > m:
                        cache.popitem(last=False)
            counts.append(misses)
        first += counts[0]
        later += counts[-1]
    return first / (trials * k), later / (trials * k)


def _check_positive(name: str, value: float) -> None:
    if not value > 0:
        raise InvalidArgumentError(f"{name} must be > 0, got {value!r}")


def plan_capacity(work: Workload, target: Cluster) -> CapacityPlan:
    """Predict what ``target`` training on ``work`` needs; see the module docstring.

    Raises:
        InvalidArgumentError: A count or size that is not positive (``index_bytes_per_sample``,
            the CPU costs and ``cache_bytes`` may be 0).
    """
    check_int("samples", work.samples, minimum=1)
    check_int("gpus", target.gpus, minimum=1)
    check_int("gpus_per_node", target.gpus_per_node, minimum=1)
    check_int("batch_size", target.batch_size, minimum=1)
    check_int("workers", target.workers, minimum=1)
    check_int("window", target.window, minimum=1)
    check_int("prefetch_shards", target.prefetch_shards, minimum=0)
    check_int("cache_bytes", target.cache_bytes, minimum=0)
    if target.block_size is not None:
        check_int("block_size", target.block_size, minimum=1)
    for name, value in (
        ("sample_bytes", work.sample_bytes),
        ("samples_per_gpu", target.samples_per_gpu),
        ("shard_bytes", target.shard_bytes),
        ("node_bandwidth", target.node_bandwidth),
        ("store_bandwidth", target.store_bandwidth),
        ("store_requests", target.store_requests),
    ):
        _check_positive(name, value)
    nodes = math.ceil(target.gpus / target.gpus_per_node)
    rate = target.gpus * target.samples_per_gpu
    epoch_s = work.samples / rate
    per_shard = max(1, min(work.samples, round(target.shard_bytes / work.sample_bytes)))
    shards = math.ceil(work.samples / per_shard)
    index_bytes = per_shard * work.index_bytes_per_sample
    object_bytes = per_shard * work.sample_bytes + index_bytes
    requests_per_shard = _requests(per_shard * work.sample_bytes) + _requests(index_bytes)
    node_run = target.batch_size * target.gpus_per_node  # L
    step = target.batch_size * target.gpus  # G

    # Which shards a node reads, and how often.
    if target.block_size is None:
        span = target.window * per_shard
        runs = min(nodes, (span - 1) / node_run + 1)
        spread = 1.0 if target.window == 1 else 1 - (1 - 1 / runs) ** per_shard
        fraction = runs / nodes * spread
        visits = 1
        # Held outside the LRU order: the window's other shards, read at the same time.
        filling = target.window - 1
    else:
        fraction = 1 - (1 - 1 / nodes) ** per_shard
        visits = math.ceil(per_shard / target.block_size)
        filling = target.window - 1
    node_shards = shards * fraction
    footprint = node_shards * object_bytes
    # Shards differ in size: the budget holds budget / mean size of them, to the nearest one.
    slots = max(0, round(target.cache_bytes / object_bytes) - filling)
    needed = max(1, round(node_shards))
    first, later = lru_downloads(
        shards,
        needed,
        slots,
        visits,
        readers=target.gpus_per_node * target.workers,
        open_shards=target.max_open_shards,
        seed=target.seed,
    )
    holds = later == 0
    first_bytes, later_bytes = first * footprint, later * footprint
    first_req = first * node_shards * requests_per_shard
    later_req = later * node_shards * requests_per_shard
    hit_rate = 1 - later / visits

    # Epoch start: the node's part of the first `workers` global steps, plus prefetches.
    positions = target.workers * step
    if target.block_size is None:
        # Each of the node's runs lies in one or two consecutive windows of `window` shards.
        runs_shards = target.workers * (math.ceil(node_run / per_shard) + 1) * target.window
        first_shards = float(
            min(shards, math.ceil(positions / per_shard) + target.window, runs_shards)
        )
    else:
        per_window = target.window * target.block_size
        window_shards = min(shards, math.ceil(positions / per_window) * target.window)
        draws = target.workers * node_run  # samples drawn from those shards' blocks
        first_shards = window_shards * (1 - (1 - 1 / window_shards) ** draws)
    prefetch = target.gpus_per_node * target.workers * target.prefetch_shards
    burst_shards = min(node_shards, first_shards + prefetch)
    return CapacityPlan(
        nodes=nodes,
        samples_per_s=rate,
        epoch_s=epoch_s,
        shard_samples=per_shard,
        shards=shards,
        dataset_bytes=shards * object_bytes,
        requests_per_shard=requests_per_shard,
        node_read_fraction=fraction,
        visits_per_shard=visits,
        node_footprint_bytes=footprint,
        cache_slots=slots,
        cache_holds=holds,
        first_epoch_node_bytes=first_bytes,
        later_epoch_node_bytes=later_bytes,
        first_epoch_node_requests=first_req,
        later_epoch_node_requests=later_req,
        node_hit_rate=hit_rate,
        store_bandwidth_first=nodes * first_bytes / epoch_s,
        store_bandwidth_later=nodes * later_bytes / epoch_s,
        store_requests_first=nodes * first_req / epoch_s,
        store_requests_later=nodes * later_req / epoch_s,
        cpu_cores_per_gpu=target.samples_per_gpu * work.decode_cpu_ms / 1000,
        dali_cores_per_gpu=target.samples_per_gpu * work.dali_cpu_ms / 1000,
        burst_node_shards=burst_shards,
        burst_bytes=nodes * burst_shards * object_bytes,
        burst_requests=nodes * burst_shards * requests_per_shard,
        burst_s=burst_shards * object_bytes / target.node_bandwidth,
        limits=_limits(
            target,
            nodes,
            epoch_s,
            [
                ("the first epoch", first_bytes, first_req),
                ("each later epoch", later_bytes, later_req),
            ],
        ),
    )
