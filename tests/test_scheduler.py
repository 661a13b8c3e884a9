"""The admission scheduler as a state machine: random arrivals (pinned or not), completions,
failures, disconnects (while queued, detected at once or only when a slot frees), and time passing
are applied to the real scheduler and to a plain model of the rules; outcomes and counters must
agree at every step, and no request is ever lost or admitted twice."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from colibri.runtime.scheduler import Cancelled, QueueFull, QueueTimeout, Scheduler


class FakeTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock only moves when the test says so."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def time(self) -> float:
        return self.now


class Model:
    """The rules of docs/API.md "Admission", written the plain way."""

    def __init__(self, slots: int, max_queue: int, timeout: float, max_active: int) -> None:
        self.busy = [False] * slots
        self.max_active = max_active
        self.max_queue, self.timeout = max_queue, timeout
        self.waiters: list[dict] = []  # FIFO: {"id", "slot", "deadline", "flag"}
        self.outcome: dict[int, object] = {}  # id -> slot | "rejected" | "timeout" | "cancelled"
        self.counts = dict(admitted=0, completed=0, failed=0, rejected=0, timed_out=0, cancelled=0)

    def free_for(self, slot):
        if sum(self.busy) >= self.max_active:
            return None
        if slot is not None:
            return None if self.busy[slot] else slot
        return next((i for i, b in enumerate(self.busy) if not b), None)

    def arrive(self, rid, slot, now, flag):
        if flag:
            self.counts["cancelled"] += 1
            self.outcome[rid] = "cancelled"
            return
        free = self.free_for(slot)
        if free is not None:
            self.admit(rid, free)
        elif len(self.waiters) >= self.max_queue:
            self.counts["rejected"] += 1
            self.outcome[rid] = "rejected"
        else:
            self.waiters.append(
                {"id": rid, "slot": slot, "deadline": now + self.timeout, "flag": False}
            )

    def admit(self, rid, slot):
        self.busy[slot] = True
        self.counts["admitted"] += 1
        self.outcome[rid] = slot

    def dispatch(self, now):
        for w in list(self.waiters):
            if sum(self.busy) >= self.max_active:
                return
            if now >= w["deadline"]:
                self.expire(w)
            elif w["flag"]:
                self.waiters.remove(w)
                self.counts["cancelled"] += 1
                self.outcome[w["id"]] = "cancelled"
            elif (free := self.free_for(w["slot"])) is not None:
                self.waiters.remove(w)
                self.admit(w["id"], free)

    def expire(self, w):
        self.waiters.remove(w)
        self.counts["timed_out"] += 1
        self.outcome[w["id"]] = "timeout"

    def release(self, slot, outcome, now):
        self.busy[slot] = False
        self.counts[outcome] += 1
        self.dispatch(now)

    def tick(self, now):
        for w in list(self.waiters):
            if now >= w["deadline"]:
                self.expire(w)


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = FakeTimeLoop()
        self.started = False

    @initialize(
        slots=st.integers(1, 4),
        max_queue=st.sampled_from([0, 1, 2, 3, 3, 4]),
        timeout=st.sampled_from([1.0, 5.0]),
        fewer_active=st.integers(0, 3),
    )
    def start(self, slots, max_queue, timeout, fewer_active):
        """Several requests active at once (every slot, or ``--max-active`` fewer)."""
        self.started = True
        max_active = max(1, slots - fewer_active)
        self.sched = Scheduler(slots, max_queue, timeout, max_active=max_active)
        self.model = Model(slots, max_queue, timeout, max_active)
        self.tasks: dict[int, asyncio.Task] = {}
        self.flags: dict[int, bool] = {}
        self.leases: dict[int, object] = {}
        self.done: set[int] = set()
        self.next_id = 0

    def settle(self) -> None:
        for _ in range(4):
            self.loop.run_until_complete(asyncio.sleep(0))
        self.model.tick(self.loop.now)  # the loop ran its due timers
        for rid, task in self.tasks.items():
            if task.done() and rid not in self.done:
                self.done.add(rid)
                if task.cancelled():
                    continue
                exc = task.exception()
                if exc is None:
                    self.leases[rid] = task.result()

    def outcome(self, rid):
        task = self.tasks[rid]
        if not task.done():
            return "waiting"
        if task.cancelled():
            return "cancelled"
        exc = task.exception()
        if exc is None:
            return task.result().slot
        return {QueueFull: "rejected", QueueTimeout: "timeout", Cancelled: "cancelled"}[type(exc)]

    def one_arrival(self, pin, gone):
        slot = None if pin is None or pin >= self.sched.capacity else pin
        rid = self.next_id
        self.next_id += 1
        self.flags[rid] = gone
        self.tasks[rid] = self.loop.create_task(
            self.sched.acquire(slot, lambda rid=rid: self.flags[rid])
        )
        # The task runs (and arrives) at the next settle, in creation order.
        self.arrivals.append((rid, slot, gone))

    @precondition(lambda self: self.started)
    @rule(
        requests=st.lists(
            st.tuples(st.one_of(st.none(), st.integers(0, 3)), st.booleans()),
            min_size=1,
            max_size=4,
        )
    )
    def arrive(self, requests):
        self.arrivals = []
        for pin, gone in requests:
            self.one_arrival(pin, gone)
        for rid, slot, gone in self.arrivals:
            self.model.arrive(rid, slot, self.loop.now, gone)
        self.settle()

    def active_ids(self):
        return sorted(r for r, lease in self.leases.items() if not lease.released)

    @precondition(lambda self: self.started and self.active_ids())
    @rule(data=st.data(), outcome=st.sampled_from(["completed", "failed", "cancelled"]))
    def finish(self, data, outcome):
        rid = data.draw(st.sampled_from(self.active_ids()))
        lease = self.leases[rid]
        self.sched.release(lease, outcome)
        self.model.release(lease.slot, outcome, self.loop.now)
        self.settle()

    def waiting_ids(self):
        return [w["id"] for w in self.model.waiters]

    @precondition(lambda self: self.started and self.model.waiters)
    @rule(data=st.data())
    def disconnect_now(self, data):
        """The client's disconnect is seen while it waits: its task is cancelled."""
        rid = data.draw(st.sampled_from(self.waiting_ids()))
        self.tasks[rid].cancel()
        w = next(w for w in self.model.waiters if w["id"] == rid)
        self.model.waiters.remove(w)
        self.model.counts["cancelled"] += 1
        self.model.outcome[rid] = "cancelled"
        self.settle()

    @precondition(lambda self: self.started and self.model.waiters)
    @rule(data=st.data())
    def disconnect_quietly(self, data):
        """The client is gone, but this is only noticed when a slot could be taken."""
        rid = data.draw(st.sampled_from(self.waiting_ids()))
        self.flags[rid] = True
        next(w for w in self.model.waiters if w["id"] == rid)["flag"] = True

    @precondition(lambda self: self.started)
    @rule(dt=st.sampled_from([0.5, 1.0, 2.0, 6.0]), quietly=st.booleans())
    def time_passes(self, dt, quietly):
        """Time moves; unless ``quietly``, the loop runs its timers at once. Quietly, the next
        event (e.g. a release) sees overdue waiters before their timers ran."""
        self.loop.now += dt
        if not quietly:
            self.settle()

    @invariant()
    def agrees_with_the_model(self):
        if not self.started:
            return
        assert self.sched.counters.__dict__ == self.model.counts
        assert self.sched.queued == len(self.model.waiters)
        assert self.sched.active == sum(self.model.busy) <= self.sched.max_active
        for rid in self.tasks:
            got = self.outcome(rid)
            assert got == self.model.outcome.get(rid, "waiting"), rid
        # Nothing lost, nothing twice: every arrival is in exactly one state.
        c = self.sched.counters
        before_admission_cancels = sum(1 for r in self.tasks if self.outcome(r) == "cancelled")
        assert len(self.tasks) == (
            c.admitted + c.rejected + c.timed_out + before_admission_cancels + self.sched.queued
        )
        slots = [self.leases[r].slot for r in self.active_ids()]
        assert len(slots) == len(set(slots)) == self.sched.active

    def teardown(self):
        if self.started:
            for task in self.tasks.values():
                task.cancel()
            self.settle()
        self.loop.close()


SchedulerMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None
)
test_scheduler_state_machine = SchedulerMachine.TestCase


def run(coro):
    loop = FakeTimeLoop()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


def test_full_queue_still_admits_to_a_free_slot():
    async def go():
        s = Scheduler(2, 0, 10)
        a = await s.acquire(0)
        with pytest.raises(QueueFull):
            await s.acquire(0)  # pinned to a busy slot, no queue: rejected even though 1 is free
        b = await s.acquire(None)  # any slot: takes the free one despite the full queue
        assert (a.slot, b.slot) == (0, 1)
        assert s.snapshot()["rejected"] == 1

    run(go())


def test_out_of_range_slot_is_refused():
    async def go():
        s = Scheduler(2, 1, 10)
        with pytest.raises(ValueError, match="0..1"):
            await s.acquire(2)

    run(go())


def test_max_active_holds_requests_back_while_slots_are_free():
    async def go():
        s = Scheduler(3, 2, 10, max_active=2)
        a, b = await s.acquire(), await s.acquire()
        third = asyncio.ensure_future(s.acquire())
        await asyncio.sleep(0)
        assert (s.active, s.queued, third.done()) == (2, 1, False)
        with pytest.raises(ValueError, match="max active must be 1..3"):
            Scheduler(3, 2, 10, max_active=4)
        s.release(a, "completed")
        lease = await third
        assert lease.slot == 0 and s.active == 2 and s.snapshot()["max_active"] == 2
        s.release(b, "completed")
        s.release(lease, "completed")
        # The queue is full and two are active: refused, saying why.
        s2 = Scheduler(3, 0, 10, max_active=2)
        await s2.acquire()
        await s2.acquire()
        with pytest.raises(QueueFull, match="2 requests are active"):
            await s2.acquire()

    run(go())
