"""Admission to KV slots: a bounded FIFO queue with slot priority, deadlines and cancellation.

The engine runs one generation per KV slot, so requests wait for a slot instead of running
unsafely side by side; at most ``max_active`` (default: every slot) hold one at once, and the
active ones step together in one batched engine step. Rules (docs/API.md, "Admission"):

- A request for any slot takes a free slot; a pinned request (``cache_slot``) takes its slot.
  When a slot frees, the earliest waiter that can use it gets it: an earlier pinned request keeps
  priority for its target, an earlier any-slot request keeps priority across all slots.
- A request that can take a free slot now is admitted at once, even when the queue is full: the
  queue limit bounds waiting requests only. Otherwise it waits if the queue has room, or is
  rejected (``QueueFull``). With ``max_queue == 0`` nothing ever waits.
- A waiter whose deadline passed is timed out (``QueueTimeout``), even if a slot has just freed:
  deadlines are checked before slot assignment. Cancellation (a client gone) is checked before a
  slot is taken, including when a waiter wakes up.

Everything runs on the event loop's thread; no locks are needed, and every state change is one
synchronous step, so the counters always add up.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Picks one of the free slots (given in ascending order) for an any-slot request.
Chooser = Callable[[list[int]], int]


class AdmissionError(Exception):
    code = "admission_error"


class QueueFull(AdmissionError):
    code = "queue_full"


class QueueTimeout(AdmissionError):
    code = "queue_timeout"


class Cancelled(AdmissionError):
    """The client went away before it was admitted."""

    code = "cancelled"


class SchedulerClosed(AdmissionError):
    code = "server_shutting_down"


@dataclass(eq=False)
class _Waiter:
    slot: int | None
    deadline: float
    is_cancelled: Callable[[], bool]
    future: asyncio.Future[int]
    choose: Chooser | None = None


@dataclass
class Lease:
    """A held slot. Give it back with :meth:`Scheduler.release` exactly once."""

    slot: int
    queue_wait_s: float
    admitted_at: float
    released: bool = field(default=False, repr=False)


@dataclass
class Counters:
    admitted: int = 0
    completed: int = 0
    failed: int = 0
    rejected: int = 0
    timed_out: int = 0
    cancelled: int = 0


class Scheduler:
    def __init__(
        self,
        slots: int,
        max_queue: int,
        queue_timeout: float,
        on_admit: Callable[[Lease], None] | None = None,
        on_release: Callable[[Lease, str, float], None] | None = None,
        clock: Callable[[], float] | None = None,
        max_active: int | None = None,
    ) -> None:
        if not 1 <= slots <= 16:
            raise ValueError(f"kv slots must be 1..16, got {slots}")
        if max_active is not None and not 1 <= max_active <= slots:
            raise ValueError(f"max active must be 1..{slots} (the KV slots), got {max_active}")
        # Requests holding a slot at once (the others wait even when a slot is free).
        self.max_active = slots if max_active is None else max_active
        if max_queue < 0 or queue_timeout <= 0:
            raise ValueError("max_queue must be >= 0 and queue_timeout > 0")
        self.capacity = slots
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.counters = Counters()
        self._busy = [False] * slots
        self._waiters: deque[_Waiter] = deque()
        self._closed = False
        # The event loop's clock by default, so deadlines and the loop's timers agree.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clock = clock or self._loop_time
        self._on_admit = on_admit
        self._on_release = on_release

    def _loop_time(self) -> float:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop.time()

    # --- state --------------------------------------------------------------------------------

    @property
    def active(self) -> int:
        return sum(self._busy)

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def snapshot(self) -> dict[str, int]:
        c = self.counters
        return {
            "active": self.active,
            "queued": self.queued,
            "capacity": self.capacity,
            "max_active": self.max_active,
            "max_queue": self.max_queue,
            "admitted": c.admitted,
            "completed": c.completed,
            "failed": c.failed,
            "rejected": c.rejected,
            "timed_out": c.timed_out,
            "cancelled": c.cancelled,
        }

    def busy_slots(self) -> list[int]:
        return [i for i, b in enumerate(self._busy) if b]

    # --- admission ----------------------------------------------------------------------------

    def _free_slot(self, slot: int | None, choose: Chooser | None = None) -> int | None:
        if self.active >= self.max_active:
            return None
        if slot is not None:
            return None if self._busy[slot] else slot
        free = [i for i, b in enumerate(self._busy) if not b]
        if not free:
            return None
        # Which free slot an any-slot request takes is not a priority question; the caller may
        # prefer the one whose KV history it shares most (default: the lowest).
        return choose(free) if choose is not None else free[0]

    def check_slot(self, slot: int | None) -> None:
        if slot is not None and not 0 <= slot < self.capacity:
            raise ValueError(f"cache_slot must be in 0..{self.capacity - 1}, got {slot}")

    async def acquire(
        self,
        slot: int | None = None,
        is_cancelled: Callable[[], bool] = lambda: False,
        choose: Chooser | None = None,
    ) -> Lease:
        """Waits for a slot. Raises QueueFull, QueueTimeout, Cancelled or SchedulerClosed.

        Cancelling the awaiting task (a client that disconnected) counts as a cancellation and
        leaves no trace in the queue or the slots.
        """
        self.check_slot(slot)
        if self._closed:
            raise SchedulerClosed("the server is shutting down")
        start = self._clock()
        if is_cancelled():
            self.counters.cancelled += 1
            raise Cancelled("client disconnected before admission")
        free = self._free_slot(slot, choose)
        if free is not None:
            return self._admit(free, start)
        if len(self._waiters) >= self.max_queue:
            self.counters.rejected += 1
            if self.active >= self.max_active and self.max_active < self.capacity:
                target = f"{self.max_active} requests are active (the most that run at once)"
            elif slot is not None:
                target = f"slot {slot} is busy"
            else:
                target = "every slot is busy"
            raise QueueFull(
                f"the admission queue is full ({self.max_queue} waiting) and {target}; retry later"
            )
        loop = asyncio.get_running_loop()
        waiter = _Waiter(
            slot, start + self.queue_timeout, is_cancelled, loop.create_future(), choose
        )
        self._waiters.append(waiter)
        timer = loop.call_at(waiter.deadline, self._expire, waiter)
        try:
            assigned = await waiter.future
        except asyncio.CancelledError:
            self._abandon(waiter)
            raise
        finally:
            timer.cancel()
        # The slot was reserved for us by _dispatch; check the client once more on waking.
        if is_cancelled():
            self._busy[assigned] = False
            self.counters.cancelled += 1
            self._dispatch()
            raise Cancelled("client disconnected while queued")
        return self._admit(assigned, start)

    def _admit(self, slot: int, start: float) -> Lease:
        self._busy[slot] = True
        self.counters.admitted += 1
        now = self._clock()
        lease = Lease(slot, now - start, now)
        if self._on_admit is not None:
            self._on_admit(lease)
        return lease

    def _abandon(self, waiter: _Waiter) -> None:
        """The waiting task was cancelled: forget it, and free a slot reserved for it."""
        if waiter in self._waiters:
            self._waiters.remove(waiter)
        elif waiter.future.done():
            if waiter.future.exception() is not None:
                return  # already timed out, cancelled or closed: counted there
            self._busy[waiter.future.result()] = False
            self._dispatch()
        self.counters.cancelled += 1

    def _expire(self, waiter: _Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            self.counters.timed_out += 1
            waiter.future.set_exception(
                QueueTimeout(f"no slot became free within {self.queue_timeout:g} s; retry later")
            )

    def _dispatch(self) -> None:
        """Hands free slots to waiters in FIFO order (deadline, then cancellation, first)."""
        now = self._clock()
        for waiter in list(self._waiters):
            if self.active >= self.max_active:
                return
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            if now >= waiter.deadline:
                self._expire(waiter)
                continue
            if waiter.is_cancelled():
                self._waiters.remove(waiter)
                self.counters.cancelled += 1
                waiter.future.set_exception(Cancelled("client disconnected while queued"))
                continue
            free = self._free_slot(waiter.slot, waiter.choose)
            if free is None:
                continue
            self._waiters.remove(waiter)
            self._busy[free] = True  # reserved until the waiter wakes and is admitted
            waiter.future.set_result(free)

    def release(self, lease: Lease, outcome: str) -> None:
        """``outcome``: "completed", "failed" (an error after admission) or "cancelled"."""
        if lease.released:
            raise RuntimeError("lease released twice")
        lease.released = True
        self._busy[lease.slot] = False
        if outcome == "completed":
            self.counters.completed += 1
        elif outcome == "failed":
            self.counters.failed += 1
        elif outcome == "cancelled":
            self.counters.cancelled += 1
        else:
            raise ValueError(f"unknown outcome {outcome!r}")
        if self._on_release is not None:
            self._on_release(lease, outcome, self._clock() - lease.admitted_at)
        self._dispatch()

    def close(self) -> None:
        """Refuses new requests and fails every waiter (server shutdown)."""
        self._closed = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.future.done():
                waiter.future.set_exception(SchedulerClosed("the server is shutting down"))
