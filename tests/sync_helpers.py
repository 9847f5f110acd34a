"""Counting the calls that make the host wait for the device (a "host sync").

On CUDA, reading a tensor's value on the host (`bool(t)`, `int(t)`, `.item()`, `.tolist()`),
an op whose output size depends on values (`nonzero`, boolean-mask indexing,
`masked_select`, `unique`), `torch.equal` and a copy to the CPU all wait for every queued
kernel. On CPU tensors none of them waits, so `SyncRecorder` records the *calls*, through a
`TorchFunctionMode`, wherever the tensors live: a test on CPU then shows what would sync on a GPU.

A copy counts when it is `.cpu()`, `.numpy()` or `.to("cpu")` spelt with the string "cpu";
`.to(some_device)` is a move to wherever the model lives and is not counted.
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
"""Methods that hand a tensor's values to the host."""
VALUE_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "equal"}
"""Ops whose output size (or answer) depends on the tensor's values."""
INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}


def _bool_index(index) -> bool:
    items = index if isinstance(index, (tuple, list)) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def _to_cpu(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(t == "cpu" for t in targets if isinstance(t, str))


class SyncRecorder(TorchFunctionMode):
    """Record every call that would make the host wait for a GPU. `calls` holds, per call,
    the op's name and the innermost reasonkv (or test) frame that made it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        sync = (
            name in READS
            or name in VALUE_SHAPED
            or (name in INDEXING and len(args) > 1 and _bool_index(args[1]))
            or (name == "where" and len(args) == 1 and not kwargs)
            or (name == "repeat_interleave" and len(args) > 1 and isinstance(args[1], torch.Tensor))
            or (name == "to" and _to_cpu(args, kwargs))
        )
        if sync:
            self.calls.append((name, _caller()))
        return func(*args, **kwargs)

    def counts(self) -> Counter:
        return Counter(self.calls)

    def __len__(self) -> int:
        return len(self.calls)


def _caller() -> str:
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "reasonkv" in frame.filename or "/tests/" in frame.filename:
            short = frame.filename.split("src/")[-1]
            return f"{short}:{frame.lineno} {frame.name}"
    frame = traceback.extract_stack()[-3]
    return f"{frame.filename}:{frame.lineno}"
