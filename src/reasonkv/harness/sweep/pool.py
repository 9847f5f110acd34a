"""Workers and pools: who runs the tasks, and the dispatcher that hands them out.

`SerialPool` runs tasks in this process, one at a time (any number of simulated workers:
it exercises the same dispatch as Ray, in order). `RayPool` holds one Ray actor per
worker; an actor keeps the model of its last task loaded and the dispatcher hands it tasks
of that model first, so a model loads once per worker.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import socket
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from reasonkv.core.models import load_model, resolve_dtype
from reasonkv.harness.sweep.grid import GridError
from reasonkv.harness.sweep.log import versions
from reasonkv.harness.sweep.tasks import error_record, eval_task, replay_task
from reasonkv.harness.sweep.units import Task


def resolve_loader(spec: str | None) -> Callable:
    """The model loader: this module's `load_model` (looked up when called, so tests can
    replace it), or "module:function" (importable by every worker: Ray imports it by name)."""
    if spec is None:
        return load_model
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"loader must be 'module:function', got {spec!r}")
    return getattr(importlib.import_module(module), attr)


def check_placement(model, device: str, dtype: str) -> None:
    """The units record `device` and `dtype`: a loader that put the model elsewhere fails them."""
    want = torch.device(device)
    param = next(model.parameters(), None)
    if param is None:
        return
    here = param.device
    if (
        here.type != want.type
        or (want.index is not None and here.index != want.index)
        or param.dtype != resolve_dtype(dtype)
    ):
        got = str(param.dtype).removeprefix("torch.")
        raise ValueError(
            f"the loader returned a model in {got} on {here}; the grid asks for {dtype} on {device}"
        )


class SweepWorker:
    """Runs tasks; keeps the last task's model loaded (one model at a time)."""

    def __init__(self, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.model_id: tuple | None = None
        self.model = self.tokenizer = None

    def _load(self, task: Task) -> float:
        if self.model_id == task.model_id:
            return 0.0
        from reasonkv.util.runtime import quiet_loading

        self.model = self.tokenizer = self.model_id = None
        gc.collect()  # free the previous model before the next one loads
        start = time.perf_counter()
        threads = torch.get_num_threads()  # the sweep's count (--threads), which load_model's
        # REASONKV_THREADS must not replace: it is set again after loading.
        # Every loader gets the grid's device and dtype (default cpu, float32), never its own
        # "auto": a sweep resumed on a GPU host must not append bf16 units under fp32 keys.
        with quiet_loading():
            model, tokenizer = resolve_loader(task.loader)(
                task.model, attn_implementation=task.attn, device=task.device, dtype=resolve_dtype(task.dtype)
            )
        torch.set_num_threads(threads)
        check_placement(model, task.device, task.dtype)
        self.model, self.tokenizer, self.model_id = model, tokenizer, task.model_id
        return time.perf_counter() - start

    def run(self, task: Task) -> list[dict]:
        try:
            load_seconds = self._load(task)
        except Exception as err:
            return [error_record(u, err, phase="load") for u in task.units]
        runner = replay_task if task.kind == "replay" else eval_task
        records = runner(self.model, self.tokenizer, task)
        about = {"host": socket.gethostname(), "pid": os.getpid(), "threads": torch.get_num_threads()}
        env = versions()
        for r in records:
            r["timings"]["load_seconds"] = load_seconds
            r["versions"] = env
            r["worker"] = about
        return records


class Pool(Protocol):
    size: int

    def submit(self, worker: int, task: Task) -> Any: ...
    def wait(self, handles: list) -> list: ...
    def result(self, handle) -> list[dict]: ...
    def replace(self, worker: int) -> None: ...
    def close(self) -> None: ...


class SerialPool:
    """`size` workers simulated in this process: each has its own SweepWorker (its own
    model), tasks run when waited for, oldest first. Ctrl-C reaches the running task."""

    def __init__(self, size: int = 1, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.size = size
        self.workers = [SweepWorker() for _ in range(size)]
        self._queue: dict[int, tuple[int, Task]] = {}
        self._done: dict[int, list[dict]] = {}
        self._next = 0

    def submit(self, worker: int, task: Task) -> int:
        self._next += 1
        self._queue[self._next] = (worker, task)
        return self._next

    def wait(self, handles: list) -> list:
        handle = min(handles)
        worker, task = self._queue.pop(handle)
        self._done[handle] = self.workers[worker].run(task)
        return [handle]

    def result(self, handle) -> list[dict]:
        return self._done.pop(handle)

    def replace(self, worker: int) -> None:
        self.workers[worker] = SweepWorker()

    def close(self) -> None:
        self.workers = []


class RayPool:
    """One Ray actor per worker (`num_cpus=threads` each). address=None starts a local
    Ray instance sized for the workers; otherwise joins that cluster (reasonkv must be
    installed on its nodes)."""

    def __init__(self, size: int, threads: int, address: str | None = None) -> None:
        try:
            import ray
        except ImportError:
            raise GridError(
                "--workers > 1 and --ray need Ray: pip install 'reasonkv[eval]' (or ray)"
            ) from None
        import logging

        self.ray = ray
        self.size, self.threads = size, threads
        self.started = not ray.is_initialized()
        if self.started:
            kwargs: dict[str, Any] = {
                "include_dashboard": False,
                "log_to_driver": False,
                "logging_level": logging.WARNING,
            }
            if address is None:  # every actor must fit, even with more workers than cores
                kwargs["num_cpus"] = max(os.cpu_count() or 1, size * threads)
            try:
                ray.init(address=address, **kwargs)
            except (ConnectionError, RuntimeError) as err:
                raise GridError(f"could not start Ray{f' at {address}' if address else ''}: {err}") from None
        self.actor_class = ray.remote(num_cpus=threads)(SweepWorker)
        self.actors = [self.actor_class.remote(threads) for _ in range(size)]

    def submit(self, worker: int, task: Task):
        return self.actors[worker].run.remote(task)

    def wait(self, handles: list) -> list:
        ready, _ = self.ray.wait(handles, num_returns=1)
        return ready

    def result(self, handle) -> list[dict]:
        return self.ray.get(handle)

    def replace(self, worker: int) -> None:
        with contextlib.suppress(Exception):
            self.ray.kill(self.actors[worker])
        self.actors[worker] = self.actor_class.remote(self.threads)

    def close(self) -> None:
        for actor in self.actors:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)
        self.actors = []
        if self.started:
            self.ray.shutdown()


def _pick(pending: list[Task], current: tuple | None, busy_models: set) -> int:
    """The next task for a free worker: one of the model it holds, else one of a model no
    busy worker holds (models spread over workers), else the oldest."""
    for want in (lambda t: t.model_id == current, lambda t: t.model_id not in busy_models):
        for i, t in enumerate(pending):
            if want(t):
                return i
    return 0


def dispatch(tasks: list[Task], pool: Pool, on_done: Callable[[Task, list[dict]], None]) -> None:
    """Run every task on the pool's workers, one task per worker at a time; on_done(task,
    records) as each finishes. A task whose worker died (the actor crashed, e.g. killed
    for memory) ends as error records and the worker is replaced."""
    pending = list(tasks)
    idle = list(range(pool.size))
    held: list[tuple | None] = [None] * pool.size
    inflight: dict[Any, tuple[int, Task]] = {}
    while pending or inflight:
        while idle and pending:
            worker = idle.pop(0)
            busy = {held[w] for w, _ in inflight.values()}
            task = pending.pop(_pick(pending, held[worker], busy))
            held[worker] = task.model_id
            inflight[pool.submit(worker, task)] = (worker, task)
        for handle in pool.wait(list(inflight)):
            worker, task = inflight.pop(handle)
            try:
                records = pool.result(handle)
            except Exception as err:  # the worker itself failed, not the task's code
                records = [error_record(u, err, phase="worker") for u in task.units]
                pool.replace(worker)
                held[worker] = None
            idle.append(worker)
            on_done(task, records)
