"""All-reduce backend: one asynchronous torch.distributed all-reduce per bucket."""

from __future__ import annotations

from collections.abc import Callable

import torch.distributed as dist

from commsched.backends.base import Backend, CompletedHandle, Handle, wait_or_raise
from commsched.buckets import Bucket


class _WorkHandle:
    """A torch.distributed ``Work`` whose failure or timeout becomes a clear error."""

    __slots__ = ("_work", "_bucket", "_start", "_end")

    def __init__(self, work: dist.Work, bucket: Bucket, start: int, end: int):
        self._work = work
        self._bucket = bucket  # keeps the buffer alive while the work runs
        self._start, self._end = start, end

    def wait(self, timeout_s: float) -> None:
        bucket = self._bucket
        wait_or_raise(
            self._work, timeout_s,
            f"the all-reduce of gradient bucket {bucket.index} (elements {self._start}:{self._end} "
            f"of {bucket.flat.numel()}, {bucket.nbytes} bytes in all)",
        )

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def on_complete(self, callback: Callable[[], None]) -> None:
        self._work.get_future().add_done_callback(lambda future: callback())


class AllReduceBackend(Backend):
    """Sums each bucket over the process group with ``all_reduce(async_op=True)``."""

    def __init__(self, process_group: dist.ProcessGroup):
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)

    def launch(self, bucket: Bucket, start: int = 0, end: int | None = None) -> Handle:
        if self.world_size == 1:
            return _COMPLETED
        end = bucket.flat.numel() if end is None else end
        work = dist.all_reduce(bucket.flat[start:end], group=self.process_group, async_op=True)
        return _WorkHandle(work, bucket, start, end)

    def forget_process_groups(self) -> None:
        self.process_group = None  # type: ignore[assignment]


_COMPLETED = CompletedHandle()
