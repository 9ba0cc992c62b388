"""What :class:`fastload.DataLoader` and ``fastload.dali.DALILoader`` share about their bookkeeping:
the counters behind ``stats()`` and the checks on a saved ``state_dict`` — one definition, so both
loaders report the same keys and accept each other's state."""

from __future__ import annotations

from typing import Any

from fastload.errors import InvalidArgumentError

__all__ = ["LoaderStats", "check_pending_resume", "parse_state_position"]


def parse_state_position(state: Any, *, version: int, what: str) -> tuple[int, int, int]:
    """``(epoch, step, global_batch_size)`` of a loader state dict, after checking its version.

    Args:
        state: What ``state_dict()`` returned.
        version: The state version this fastload writes.
        what: The loader's name, for messages.

    Raises:
        InvalidArgumentError: Not a state dict, another version, or malformed fields.
    """
    if not isinstance(state, dict) or "version" not in state:
        raise InvalidArgumentError(
            f"not a fastload {what} state dict (no 'version'); pass what state_dict() returned"
        )
    if state["version"] != version:
        raise InvalidArgumentError(
            f"state dict version {state['version']!r} is not supported (this fastload writes "
            f"version {version}); resume with the fastload version that saved it"
        )
    try:
        epoch, step = int(state["epoch"]), int(state["step"])
        saved_g = int(state["global_batch_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"malformed {what} state dict: {exc!r}") from exc
    if epoch < 0 or step < 0:
        raise InvalidArgumentError(f"state dict has negative epoch/step: {epoch}, {step}")
    return epoch, step, saved_g


def check_pending_resume(
    epoch: int, *, pending_epoch: int, pending_step: int | None, total_steps: int
) -> None:
    """Refuse ``set_epoch(epoch)`` when it would drop a resume into the middle of another epoch.

    Both loaders call this from ``set_epoch`` (unless ``discard_resume=True``): a pending resume
    (``load_state_dict`` done, not yet iterated) of epoch ``pending_epoch`` at global step
    ``pending_step`` of ``total_steps`` would otherwise be replaced by ``epoch`` from step 0,
    silently re-training or skipping the rest of the saved epoch. Same epoch, no pending resume,
    or one at step 0 or at the end of its epoch (nothing partial to lose): no error.

    Raises:
        InvalidArgumentError: The resume would be dropped; the message names the pending epoch
            and step and how to finish it or discard it on purpose.
    """
    if pending_step is None or epoch == pending_epoch or not 0 < pending_step < total_steps:
        return
    raise InvalidArgumentError(
        f"set_epoch({epoch}) would drop the resume that load_state_dict() set up: epoch "
        f"{pending_epoch} at global step {pending_step} of {total_steps}, with "
        f"{total_steps - pending_step} global steps not delivered yet, which would never be "
        f"trained. To finish epoch {pending_epoch} first, call set_epoch({pending_epoch}) (or "
        f"iterate without set_epoch) and move on to epoch {epoch} after it, e.g. `for epoch in "
        f"range(state['epoch'], epochs): loader.set_epoch(epoch)`; to start epoch {epoch} from "
        f"its beginning instead, call set_epoch({epoch}, discard_resume=True)"
    )


class LoaderStats:
    """Counters of one loader since it was made or reset (main process only, one thread)."""

    __slots__ = ("batches", "elapsed", "nbytes", "padded", "samples", "skipped", "stall")

    def __init__(self) -> None:
        self.batches = self.samples = self.nbytes = self.padded = self.skipped = 0
        self.elapsed = self.stall = 0.0

    def add(self, *, size: int, nbytes: int, padded: int, skipped: int) -> None:
        """Count one delivered batch."""
        self.batches += 1
        self.samples += size
        self.nbytes += nbytes
        self.padded += padded
        self.skipped += skipped

    def report(self, *, dropped_per_epoch: int, epoch: int, step: int) -> dict[str, float | int]:
        """The ``stats()`` dictionary.

        Keys: ``batches``, ``samples`` (delivered), ``bytes`` (raw field bytes read),
        ``elapsed_s`` (wall time inside iterations), ``samples_per_s``, ``bytes_per_s``,
        ``data_stall_s`` (time the training loop waited for the next batch), ``padded`` (repeated
        samples delivered to even out ranks), ``skipped`` (corrupt samples dropped),
        ``dropped_per_epoch`` (samples ``drop_last`` leaves out of each epoch), ``epoch``, ``step``.
        """
        rate = 1.0 / self.elapsed if self.elapsed > 0 else 0.0
        return {
            "batches": self.batches,
            "samples": self.samples,
            "bytes": self.nbytes,
            "elapsed_s": self.elapsed,
            "samples_per_s": self.samples * rate,
            "bytes_per_s": self.nbytes * rate,
            "data_stall_s": self.stall,
            "padded": self.padded,
            "skipped": self.skipped,
            "dropped_per_epoch": dropped_per_epoch,
            "epoch": epoch,
            "step": step,
        }
