"""Host swap space bookkeeping: a bounded number of host pages that hold preempted sequences' KV."""
from collections import deque


class SwapSpace:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """`count` host pages, or None when there is not enough room (the caller recomputes instead)."""
        if count > len(self._free):
            return None
        return [self._free.popleft() for _ in range(count)]

    def release(self, slots: list[int]) -> None:
        self._free.extend(slots)
