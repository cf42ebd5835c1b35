"""The local tier: a least-recently-used map bounded by the bytes of its values."""

from __future__ import annotations

from collections import OrderedDict


class ByteLRU:
    """Values are bytes; keys count a fixed overhead each, so many tiny entries still fill it."""

    KEY_OVERHEAD = 100  # bytes an entry costs beyond its value: key string, dict slot, links

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self.evictions = 0
        self._items: OrderedDict[str, bytes] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: str) -> bytes | None:
        value = self._items.get(key)
        if value is not None:
            self._items.move_to_end(key)
        return value

    def put(self, key: str, value: bytes) -> None:
        cost = len(value) + self.KEY_OVERHEAD
        if cost > self.max_bytes:
            return
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= len(old) + self.KEY_OVERHEAD
        while self._items and self.bytes + cost > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.bytes -= len(evicted) + self.KEY_OVERHEAD
            self.evictions += 1
        self._items[key] = value
        self.bytes += cost
