"""Steps the engine's streams together: every generation that is waiting for its next step
runs in one batched engine step (``Engine.step_many``: one forward pass reads each weight once
for all of them), on the engine's one thread.

The loop, on the event loop's thread: wait until some stream asks for a step; give every other
live generation a moment (at most ``GATHER_S``, and at most a quarter of the last step's time)
to ask too, since each one does a little Python
work (detokenizing, writing its SSE chunk) between two steps; then step all that asked at once.
A stream that asks while a step runs joins the next. Scorings step alone, between batches. A
generation prefilling a long prompt steps a part of about half a second at a time, so the others
never wait for more than one such part.

Everything but the engine call runs on the event loop, so no locks are needed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from colibri.runtime.engine import Engine, _Stepped, _Tokens

# How long a step waits at most for the live generations that have not asked yet (each asks
# again within well under a millisecond of getting its token unless its client is slow to
# read), and at most this share of the last batched step's time (a fast model's step is a few
# milliseconds: a slow reader must not halve the others' speed).
GATHER_S = 0.005
GATHER_SHARE = 0.25

StepResult = int | tuple[int, int] | None


class Batcher:
    def __init__(
        self,
        engine: Engine,
        thread: ThreadPoolExecutor,
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._engine = engine
        self._thread = thread
        self._on_batch = on_batch
        # Generations between their first and last step, and those waiting for a step.
        self._live: set[_Tokens] = set()
        self._waiting: dict[_Tokens, asyncio.Future[StepResult]] = {}
        self._solo: deque[tuple[_Stepped, asyncio.Future[StepResult]]] = deque()
        self._asked = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._last_step_s = GATHER_S / GATHER_SHARE

    def join(self, tokens: _Tokens) -> None:
        """A generation that will ask for steps until it ``leave``s."""
        self._live.add(tokens)

    def leave(self, tokens: _Tokens) -> None:
        self._live.discard(tokens)
        self._asked.set()  # a gathering step need not wait for it any more

    async def step(self, tokens: _Tokens) -> StepResult:
        """The generation's next step, run together with the others waiting."""
        return await self._ask(lambda fut: self._waiting.__setitem__(tokens, fut), tokens)

    async def step_alone(self, stepped: _Stepped) -> StepResult:
        """A step of a stream that does not batch (a scoring), between batched steps."""
        return await self._ask(lambda fut: self._solo.append((stepped, fut)), None)

    async def _ask(
        self, enqueue: Callable[[asyncio.Future[StepResult]], None], tokens: _Tokens | None
    ) -> StepResult:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._task = loop.create_task(self._run(), name="colibri-batcher")
        fut: asyncio.Future[StepResult] = loop.create_future()
        enqueue(fut)
        self._asked.set()
        try:
            return await fut
        except asyncio.CancelledError:
            # Gone before its step was taken: it must not run.
            if tokens is not None and self._waiting.get(tokens) is fut:
                del self._waiting[tokens]
            raise

    async def _gather(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(GATHER_S, GATHER_SHARE * self._last_step_s)
        while self._live - self._waiting.keys():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._asked.clear()
            try:
                await asyncio.wait_for(self._asked.wait(), left)
            except TimeoutError:
                return

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting and not self._solo:
                self._asked.clear()
                await self._asked.wait()
            if self._solo:
                stepped, fut = self._solo.popleft()
                if not fut.done():
                    await self._settle(
                        [fut], loop.run_in_executor(self._thread, stepped.step), single=True
                    )
                continue
            await self._gather()
            batch = list(self._waiting.items())
            self._waiting.clear()
            if not batch:
                continue
            if self._on_batch is not None:
                self._on_batch(len(batch))
            streams = [t for t, _ in batch]
            started = loop.time()
            await self._settle(
                [f for _, f in batch],
                loop.run_in_executor(self._thread, self._engine.step_many, streams),
                single=False,
            )
            self._last_step_s = loop.time() - started

    @staticmethod
    async def _settle(
        futures: list[asyncio.Future[StepResult]], call: asyncio.Future[Any], single: bool
    ) -> None:
        """Hands each waiter its result (or exception) from the engine call ``call``."""
        try:
            out = await call
        except Exception as e:  # the engine call itself failed: every waiter gets it
            for fut in futures:
                if not fut.done():
                    fut.set_exception(e)
            return
        results = [out] if single else out
        for fut, r in zip(futures, results, strict=True):
            if fut.done():
                continue  # its waiter was cancelled meanwhile; the step stays in the slot
            if isinstance(r, Exception):
                fut.set_exception(r)
            else:
                fut.set_result(r)
