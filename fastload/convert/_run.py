"""A conversion's run: what it holds from before planning to its end, and the writing of its shards.

:func:`running` is the one ``try``/``finally`` of a conversion. It gives a
:class:`ConversionRun`, which :func:`fastload.convert` takes through its steps: the executor
chosen and started early (:meth:`~ConversionRun.start`), the destination made this conversion's
(:meth:`~ConversionRun.claim`, :meth:`~ConversionRun.begin_writing`), the shards written
(:meth:`~ConversionRun.write`). Whatever happens, :func:`running` then releases what the run
holds, in one documented order, and on Ctrl-C says how far the conversion got.

**Ctrl-C.** The first one raises ``KeyboardInterrupt`` in the converting process (worker
processes ignore it): the executor says what its shards being written become
(:attr:`~fastload.convert._pool.Executor.interrupt_notice`: the pool's workers finish them),
then is shut down. Every later one only hurries the stop
(:func:`~fastload._os.interrupts_escalate`): it calls the executor's
:meth:`~fastload.convert._pool.Executor.stop_now` and never interrupts the clean-up, so the
command ends promptly with the note of :func:`~fastload.convert._state.interrupted_note` on the
exception (and printed unless ``quiet``).
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

from fastload._os import interrupts_escalate
from fastload.convert._engines import ExecutorChoice
from fastload.convert._guard import Guard
from fastload.convert._options import ConvertOptions
from fastload.convert._plan import PlanStream
from fastload.convert._pool import ShardRecords, run_jobs
from fastload.convert._space import space_for
from fastload.convert._state import (
    PLAN_KEY,
    Found,
    check_destination,
    check_leftovers,
    interrupted_note,
    write_plan,
)
from fastload.convert._worker import ShardJob
from fastload.storage import Store

__all__ = ["ConversionRun", "running"]


@contextlib.contextmanager
def running(options: ConvertOptions) -> Iterator[ConversionRun]:
    """A conversion's run, released at the end of the ``with`` block whatever happens, in this
    order: the executor shut down (its workers waited for: their writers are done after it),
    the destination's lock released, then, after Ctrl-C, the note saying how far it got; the
    escalation of later Ctrl-Cs is in force until all of that is done (module docstring)."""
    run = ConversionRun(options)
    with interrupts_escalate(run.stop_now):
        interrupted: KeyboardInterrupt | None = None
        try:
            yield run
        except KeyboardInterrupt as exc:
            interrupted = exc
            notice = run.executors.interrupt_notice if run.executors is not None else None
            if notice is not None and run.phase == "writing":
                run.say(f"interrupted; {notice}")
            raise
        finally:
            run.end(interrupted)


class ConversionRun:
    """What one conversion holds while it runs (see :func:`running`).

    Args:
        options: The conversion's options.
    """

    def __init__(self, options: ConvertOptions) -> None:
        self.options = options
        #: The executor's choice, once :meth:`start` made it.
        self.executors: ExecutorChoice | None = None
        #: The destination store, once :meth:`start` was given it.
        self.dst: Store | None = None
        #: The destination's lock, once :meth:`claim` took it.
        self.guard: Guard | None = None
        #: The plan whose shards are written, once :meth:`begin_writing` began.
        self.plan: PlanStream | None = None
        #: ``planning``, ``writing`` (from :meth:`begin_writing`), ``finishing`` (after
        #: :meth:`write`): how far an interruption got.
        self.phase = "planning"

    def start(self, source: Store, dst: Store) -> None:
        """Choose the executor that writes the shards of ``source`` into ``dst``, and start it
        now if it gains from starting before planning (:class:`ExecutorChoice`)."""
        o = self.options
        self.dst = dst
        self.executors = ExecutorChoice(
            o.engine, o.n_workers, o.address, o.fmt, source, dst, dry_run=o.dry_run
        )
        self.executors.start_early()

    def claim(self, plan: PlanStream) -> Found:
        """Make the destination this conversion's alone (its lock: what dead runs left goes),
        and find what it holds for the plan whose first shard is cut (resume, refuse, replace:
        :func:`~fastload.convert._state.check_destination`)."""
        dst = self._dst()
        self.guard = Guard(dst, self.options.format_name)
        with space_for(dst, PLAN_KEY):
            self.guard.acquire()
        return check_destination(
            dst, plan.head_sha256, overwrite=self.options.overwrite, prefix=self.options.prefix
        )

    def begin_writing(self, plan: PlanStream, found: Found) -> None:
        """Before the first shard: abort the uploads earlier runs left unfinished, and record
        the plan (``plan.json``) unless the destination already holds it."""
        dst = self._dst()
        if self.guard is None:
            raise RuntimeError("begin_writing() before claim()")
        self.guard.abort_uploads(self.options.prefix)
        self.plan, self.phase = plan, "writing"
        if not found.resume:
            write_plan(dst, plan.head_sha256, plan.source, plan.options)

    def write(self, jobs: Iterator[ShardJob], done: ShardRecords, found: Found) -> None:
        """Write the shards of ``jobs`` (planned as they are taken) with the executor chosen
        once the first two are planned (:meth:`ExecutorChoice.runner`), then check that nothing
        is left of another plan (:func:`~fastload.convert._state.check_leftovers`)."""
        if self.executors is None or self.plan is None:
            raise RuntimeError("write() before start() and begin_writing()")
        ahead = list(itertools.islice(jobs, 2))  # one job is written in this process
        runner = self.executors.runner(several=len(ahead) > 1)
        feed = itertools.chain(ahead, jobs)
        del ahead  # the chain alone holds those two jobs, until they are written
        try:
            run_jobs(runner, feed, done, self.options.map_fn)
        finally:
            done.progress.close()
        check_leftovers(self._dst(), found, self.plan.shards)
        self.phase = "finishing"

    def stop_now(self) -> None:
        """A second Ctrl-C: have the executor abort its shards (only sets a flag)."""
        if self.executors is not None:
            self.executors.stop_now()

    def say(self, text: str) -> None:
        """Print ``fastload convert: text`` on the progress stream, unless ``quiet``."""
        if not self.options.quiet:
            self.options.stream.write(f"fastload convert: {text}\n")
            self.options.stream.flush()

    def end(self, interrupted: KeyboardInterrupt | None) -> None:
        """Release what the run holds (see :func:`running` for the order); add the note of an
        interruption to ``interrupted``."""
        try:
            if self.executors is not None:
                self.executors.shutdown()
        finally:
            if self.guard is not None:
                self.guard.release()
            if interrupted is not None:
                plan, planned = self.plan, self.phase != "planning"
                shards = plan.shards if plan is not None and planned else None
                complete = plan is not None and plan.complete
                text = interrupted_note(self.dst, shards, self.phase, complete)
                interrupted.add_note(text)
                self.say(text)

    def _dst(self) -> Store:
        if self.dst is None:
            raise RuntimeError("the destination is not known before start()")
        return self.dst
