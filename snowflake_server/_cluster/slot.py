"""The slot cluster mode serves ids from: whichever worker the node holds now, while the
session gate is open.

The worker in it changes when the node registers again under another worker id; the
gate (``gate.py``) alone decides whether ids may be handed out. A worker whose generator
state is native has the gate's deadline copied into that state while it is installed, for
native threads; calls through the slot check the gate themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from .._errors import UnavailableError
from .._ids.generator import GeneratorCounters, GeneratorSettings, IdGenerator
from .._state.worker import Worker
from .gate import SessionGate

if TYPE_CHECKING:
    from .._native._core import GeneratorState

__all__ = ["CurrentReservation", "WorkerSlot"]


class WorkerSlot:
    """The ids of whichever worker this node holds now, while ``gate`` is open.

    Closed gate, or no worker installed: calls raise ``UnavailableError`` (saying
    why) so clients go to another node. Counters add up every worker this process
    has held.
    """

    def __init__(self, placeholder: GeneratorSettings, gate: SessionGate) -> None:
        self._placeholder = placeholder
        self.gate = gate
        self._lock = threading.Lock()
        self._worker: Worker | None = None
        self._retired = GeneratorCounters()
        self._watchers: list[Callable[[GeneratorState | None], None]] = []

    @property
    def worker(self) -> Worker | None:
        return self._worker

    def install(self, worker: Worker) -> None:
        with self._lock:
            assert self._worker is None, "retire the old worker first"
            self._worker = worker
        self.gate.attach(worker.native_state)
        for watcher in self._watchers:
            watcher(worker.native_state)

    def watch(self, watcher: Callable[[GeneratorState | None], None]) -> None:
        """Tell ``watcher`` the native state of every worker installed from now on (its
        gate closed until proven) and None once it is retired (closed and sealed first),
        starting with the current one's: what native threads issue from."""
        self._watchers.append(watcher)
        worker = self._worker
        watcher(None if worker is None else worker.native_state)

    def retire(self, reason: str | None = None) -> Worker | None:
        """Close the gate (calls are told ``reason``; None: the reason already given) and
        the worker (its exact final mark is written), and take it out: the next worker
        serves only once a new registration is proven. Its ids keep counting in
        :meth:`counters`. A native state is closed, then sealed, before this returns:
        the next worker's state is made only after."""
        self.gate.close(reason)  # the native state's copy too
        worker = self._worker
        if worker is None:
            return None
        worker.close()  # sealed: its counters are final
        self.gate.attach(None)
        for watcher in self._watchers:
            watcher(None)
        with self._lock:
            self._worker = None
            self._retired += worker.generator.counters()
        return worker

    def _current(self) -> IdGenerator:
        worker = self._worker
        if worker is None or not self.gate.is_open():
            raise UnavailableError(f"this node is not handing out ids: {self.gate.reason}")
        return worker.generator

    def next_id(self) -> int:
        return self._current().next_id()

    def next_ids(self, count: int) -> list[int]:
        return self._current().next_ids(count)

    @property
    def serving(self) -> bool:
        return self._worker is not None and self.gate.is_open()

    def unavailable_reason(self) -> str | None:
        """Why a call would fail now, or None (see ``Worker.unavailable_reason``)."""
        worker = self._worker
        if worker is None or not self.gate.is_open():
            return f"this node is not handing out ids: {self.gate.reason}"
        return worker.unavailable_reason()

    @property
    def settings(self) -> GeneratorSettings:
        worker = self._worker
        return worker.generator.settings if worker is not None else self._placeholder

    def counters(self) -> GeneratorCounters:
        with self._lock:  # never a worker's ids twice, or not at all, during retire()
            worker, retired = self._worker, self._retired
            current = worker.generator.counters() if worker is not None else GeneratorCounters()
        return retired + current


class CurrentReservation(Collector):
    """The reservation metrics of whichever worker the slot holds now."""

    def __init__(self, slot: WorkerSlot) -> None:
        self._slot = slot

    def collect(self) -> Iterable[Metric]:
        worker = self._slot.worker
        if worker is not None:
            yield from worker.reservation.collect()
