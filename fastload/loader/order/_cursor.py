"""The resumable position every fastload loader keeps: one definition, so their states agree.

:class:`EpochCursor` is what :class:`fastload.DataLoader`, ``fastload.dali.DALILoader`` and
:class:`fastload.wds.WebLoader` delegate their epochs and state to: the epoch to iterate, the
global steps of it the training loop has received, a resume point set by ``load_state_dict`` and
not yet iterated, the dataset fingerprint and order options a state must match, and the
``stats()`` counters. A loader only produces batches; the cursor decides where an iteration
starts and what a state dict says.

**The state dict** (version :data:`STATE_VERSION`): ``epoch``, ``step`` (global steps of
``epoch`` handed to the training loop; a batch counts once it is yielded), ``global_batch_size``,
``num_samples``, ``world_size``, ``drop_last``, ``dataset`` (the shard list's
:attr:`~fastload.loader.Dataset.fingerprint`) and the dataset's order options (``shuffle``,
``seed``, ``block_size``, ``window``). It is O(1) in the dataset size and the same for every
rank. The torch and DALI loaders write the same keys and accept each other's states; a state
without ``dataset`` (written by DALI loaders before the fingerprint was added) is accepted on the
other checks. Loaders add their own keys (DALI's native reader, the WebLoader's sub-step
position) and checks (``extra_check``).

**Resume rules**, shared by all loaders: ``load_state_dict`` makes the next iteration start at the
saved step; ``set_epoch`` with the saved epoch keeps it; another epoch while a resume into the
middle of an epoch is pending raises (it would silently drop the rest of that epoch) unless
``discard_resume=True``. The epochs after a resumed one start at step 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from fastload.errors import InvalidArgumentError
from fastload.loader.order._order import ORDER_VERSION
from fastload.loader.order._partition import Partition
from fastload.loader.order._seeds import check_seed
from fastload.loader.order._stats import LoaderStats

__all__ = [
    "STATE_VERSION",
    "EpochCursor",
    "Resumable",
    "check_pending_resume",
    "parse_state_position",
]


class Resumable(Protocol):
    """What a cursor keeps a place in: a dataset of samples, or a token source.

    The cursor knows nothing else of it: a state names the data (:attr:`fingerprint`) and its
    order (:meth:`order_options`), and resumes only where :meth:`continues_order` agrees.
    """

    @property
    def url(self) -> str:
        """Where the data lives, for messages (no credentials)."""
        ...

    @property
    def fingerprint(self) -> str:
        """Identifies the data (O(1) after the first call); a state must carry the same."""
        ...

    def order_options(self) -> dict[str, Any]:
        """The options that decide what sits at each position of an epoch; states carry them and
        must match them."""
        ...

    def continues_order(self, version: object) -> bool:
        """Whether a state saved with epoch-order ``version`` (its ``order_version``; 1 when it
        has none) continues exactly: this fastload orders the epochs as that version did."""
        ...

    def node_stats(self) -> dict[str, int]:
        """The counters of the one node cache the data is read through, for ``stats()``; empty
        where there is none (or several)."""
        ...


#: Version of the ``state_dict()`` layout.
STATE_VERSION = 1


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

    A pending resume (``load_state_dict`` done, not yet iterated) of epoch ``pending_epoch`` at
    global step ``pending_step`` of ``total_steps`` would otherwise be replaced by ``epoch`` from
    step 0, silently re-training or skipping the rest of the saved epoch. Same epoch, no pending
    resume, or one at step 0 or at the end of its epoch (nothing partial to lose): no error.

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


class EpochCursor:
    """Epoch, step, pending resume, state checks and stats of one loader (see module doc).

    Args:
        dataset: What the loader reads (fingerprint, order options and order version of
            states): its dataset, or the token loader's
            :class:`~fastload.loader.tokens._source.TokenSource` (its sequences are the samples).
        partition: How an epoch is split into global steps on this job.
        what: The loader's name, for messages (``"DataLoader"``).
        num_steps: Global steps of an epoch when they are not ``partition.num_steps`` (DALI's
            native reader shards its own way; the same number in every epoch).

    Attributes:
        num_steps: Global steps of an epoch (batches every rank yields).
        epoch: The epoch the loader iterates (next, or now).
        step: Global steps of :attr:`epoch` handed to the training loop.
        outputs: Outputs of global step :attr:`step` already handed over, for loaders whose
            steps yield several outputs (the WebLoader); 0 for batch loaders.
        stats: The counters behind ``stats()``.

    Not thread-safe: a loader is used from one thread.
    """

    def __init__(
        self,
        dataset: Resumable,
        partition: Partition,
        *,
        what: str,
        num_steps: int | None = None,
    ) -> None:
        self.dataset = dataset
        self.partition = partition
        self.what = what
        self.num_steps = partition.num_steps if num_steps is None else num_steps
        self.epoch = 0
        self.step = 0
        self.outputs = 0
        self._resume: tuple[int, int] | None = None  # (step, outputs) for the next iteration
        self._start = 0  # step the running iteration started at
        self._iterating = False
        self.stats = LoaderStats()
        #: Called after every delivered step and at the end of each iteration, in the loader's
        #: own thread (:func:`~fastload.loader.log_stats`); not pickled.
        self.watchers: list[Callable[[], None]] = []

    @property
    def resume_pending(self) -> bool:
        """Whether ``load_state_dict`` set a start point the next iteration has not used yet."""
        return self._resume is not None

    # ---- epochs -------------------------------------------------------------------------------

    def set_epoch(self, epoch: int, *, discard_resume: bool = False) -> None:
        """Iterate ``epoch`` next, from step 0 (see the loaders' ``set_epoch``).

        Raises:
            InvalidArgumentError: A resume into the middle of another epoch is pending and
                ``discard_resume`` is false.
        """
        check_seed("epoch", epoch)
        if self._resume is not None and not discard_resume:
            if epoch == self.epoch:
                return
            check_pending_resume(
                epoch,
                pending_epoch=self.epoch,
                pending_step=self._resume[0],
                total_steps=self.num_steps,
            )
        self.epoch, self.step, self.outputs, self._resume = epoch, 0, 0, None

    def remaining(self) -> int:
        """Batches the next (or the running) iteration yields: the loaders' ``len()``."""
        if self._iterating:
            start = self._start
        else:
            start = self._resume[0] if self._resume is not None else 0
        return max(0, self.num_steps - start)

    # ---- iteration ----------------------------------------------------------------------------

    def begin(self) -> tuple[int, int, int]:
        """Start an iteration: ``(epoch, start step, outputs of the start step to skip)``; a
        pending resume is used up."""
        start, skip = self._resume if self._resume is not None else (0, 0)
        self._resume = None
        self.step, self.outputs, self._start = start, skip, start
        self._iterating = True
        return self.epoch, start, skip

    def reached(self, epoch: int, step: int, outputs: int = 0) -> None:
        """The training loop has everything of ``epoch`` before global ``step`` (and ``outputs``
        outputs of ``step``). Ignored once ``set_epoch`` moved to another epoch mid-iteration."""
        if self.epoch == epoch:
            self.step, self.outputs = step, outputs
        for watch in self.watchers:
            watch()

    def end(self) -> None:
        """The iteration ended (finished, broken off or failed)."""
        self._iterating = False
        for watch in self.watchers:
            watch()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_iterating"] = False  # a pickled loader is not iterating
        state["watchers"] = []  # a log belongs to the loader it was started on
        return state

    # ---- state --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The common state dict (see module doc); loaders may add keys."""
        p = self.partition
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "step": self.step,
            "global_batch_size": p.global_batch_size,
            "num_samples": p.num_samples,
            "world_size": p.world_size,
            "drop_last": p.drop_last,
            "dataset": self.dataset.fingerprint,
            **self.dataset.order_options(),
        }

    def load_state_dict(
        self,
        state: dict[str, Any],
        *,
        extra_check: Callable[[dict[str, Any]], None] | None = None,
        outputs: int = 0,
    ) -> None:
        """Make the next iteration continue ``state``'s epoch at its step.

        Args:
            state: What a loader's ``state_dict()`` returned (this loader's kind or another one
                with interchangeable states).
            extra_check: The loader's own checks, run after the version check and before the
                common ones; raises to refuse the state.
            outputs: Outputs of the saved step already delivered (WebLoader), checked by it.

        Raises:
            InvalidArgumentError: Another version, global batch size, dataset (sample count or
                fingerprint) or order; the message says which and how to fix it.
        """
        epoch, step, saved_g = parse_state_position(state, version=STATE_VERSION, what=self.what)
        if extra_check is not None:
            extra_check(state)
        p, ds = self.partition, self.dataset
        g, world = p.global_batch_size, p.world_size
        if saved_g != g:
            fits = saved_g % world == 0
            raise InvalidArgumentError(
                f"the state was saved with a global batch size of {saved_g} "
                f"(batch_size x world_size), but this loader has {p.batch_size} x {world} = {g}. "
                f"Resuming exactly needs the same global batch size: use "
                f"batch_size={saved_g // world if fits else '?'} with world_size={world}"
                + ("" if fits else " (not divisible: change world size)")
            )
        if state.get("num_samples") != p.num_samples:
            raise InvalidArgumentError(
                f"the state is for a dataset of {state.get('num_samples')} samples, but "
                f"{ds.url} has {p.num_samples}; resume on the same dataset"
            )
        if "dataset" in state and state["dataset"] != ds.fingerprint:
            raise InvalidArgumentError(
                f"the state was saved on another dataset (shard list fingerprint "
                f"{state['dataset']!r}, {ds.url} has {ds.fingerprint!r}: "
                "shard names, sample counts or checksums differ); resume on the same dataset"
            )
        saved_order = state.get("order_version", 1)  # states saved before order versions: 1
        if not ds.continues_order(saved_order):
            raise InvalidArgumentError(
                f"the state was saved with epoch order version {saved_order!r}, but this fastload "
                f"shuffles {ds.url} with order version {ORDER_VERSION}: resuming would repeat and "
                "skip samples. Resume with the fastload release that saved the state, or start "
                f"the next epoch (set_epoch({epoch + 1})) without loading it"
            )
        for name, value in ds.order_options().items():
            if name in state and state[name] != value:
                raise InvalidArgumentError(
                    f"the state was saved with {name}={state[name]!r} but this dataset has "
                    f"{name}={value!r}; open the dataset with the same order options to resume"
                )
        self.epoch, self.step, self.outputs = epoch, step, outputs
        self._resume = (step, outputs)

    # ---- statistics ---------------------------------------------------------------------------

    def report(self, *, dropped_per_epoch: int | None = None) -> dict[str, float | int]:
        """The ``stats()`` dictionary (keys: :meth:`~fastload.loader.order._stats.LoaderStats.report`);
        ``dropped_per_epoch`` defaults to the partition's."""
        dropped = self.partition.dropped if dropped_per_epoch is None else dropped_per_epoch
        out = self.stats.report(dropped_per_epoch=dropped, epoch=self.epoch, step=self.step)
        node = self.dataset.node_stats()
        out.update({f"node_cache_{name}": value for name, value in node.items()})
        return out

    def reset_stats(self) -> None:
        """Zero the counters."""
        self.stats = LoaderStats()
