"""The 1,000-GPU table of ``benchmarks/SCALING.md``, computed from the capacity model.

``python -m benchmarks.scaling_tables`` prints the table; ``tests/test_capacity.py`` checks that
SCALING.md holds exactly these rows, so the document and ``fastload plan-capacity`` cannot
disagree (they did once, when the model's requests per fill changed and the table did not).
"""

from __future__ import annotations

from fastload._capacity import PRESETS, CapacityPlan, Cluster, format_bytes, plan_capacity

__all__ = ["HEADER", "ROWS", "rows", "table"]

HEADER = (
    "| data | shuffle | cache/node | node reads | footprint/node | holds | hit rate "
    "| store first epoch | store later epochs | requests/s first, later "
    "| CPU cores/GPU (CPU, DALI) | epoch start per node |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|"
)

#: (data name, preset, samples/s per GPU, cache bytes per node, block size or None, window).
ROWS: tuple[tuple[str, str, float, int, int | None, int], ...] = (
    ("ImageNet", "imagenet", 2_500, 200_000_000_000, 64, 64),
    ("ImageNet", "imagenet", 2_500, 200_000_000_000, None, 1),
    ("ImageNet", "imagenet", 2_500, 50_000_000_000, 64, 64),
    ("ImageNet", "imagenet", 2_500, 50_000_000_000, None, 1),
    ("LAION", "laion", 1_500, 2_000_000_000_000, 64, 64),
    ("LAION", "laion", 1_500, 2_000_000_000_000, None, 1),
    ("LAION", "laion", 1_500, 2_000_000_000_000, None, 4),
    ("LAION", "laion", 1_500, 12_000_000_000_000, None, 1),
)


def _row(name: str, block: int | None, window: int, cache: int, p: CapacityPlan) -> str:
    shuffle = f"block {block}/{window}" if block is not None else f"streaming, window {window}"
    burst_bytes = p.burst_bytes / p.nodes
    cells = [
        name,
        shuffle,
        format_bytes(cache).replace(".0 ", " "),
        f"{p.node_read_fraction:.1%} x{p.visits_per_shard}",
        format_bytes(p.node_footprint_bytes),
        "yes" if p.cache_holds else "no",
        f"{p.node_hit_rate:.0%}",
        f"{format_bytes(p.store_bandwidth_first)}/s",
        f"{format_bytes(p.store_bandwidth_later)}/s",
        f"{p.store_requests_first:,.0f}, {p.store_requests_later:,.0f}",
        f"{p.cpu_cores_per_gpu:.2f}, {p.dali_cores_per_gpu:.2f}",
        f"{p.burst_node_shards:,.0f} shards, {format_bytes(burst_bytes)}, {p.burst_s:.1f} s",
    ]
    return "| " + " | ".join(cells) + " |"


def rows() -> list[str]:
    """The table's rows: 125 nodes x 8 GPUs, batch 256, 8 workers per GPU, 256 MB shards,
    prefetch 2, 100 Gbit/s per node (:class:`~fastload._capacity.Cluster`'s defaults)."""
    out = []
    for name, preset, per_gpu, cache, block, window in ROWS:
        target = Cluster(
            gpus=1000, samples_per_gpu=per_gpu, cache_bytes=cache, block_size=block, window=window
        )
        out.append(_row(name, block, window, cache, plan_capacity(PRESETS[preset], target)))
    return out


def table() -> str:
    """The whole Markdown table, header included."""
    return "\n".join([HEADER, *rows()])


if __name__ == "__main__":
    print(table())
