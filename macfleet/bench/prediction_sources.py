"""Source files for `macfleet bench serve --prediction` (bench/serve_prediction.py): realistic
code of 100-400 lines, fixed here so the workload does not change with the repository. Each
entry: (name, language, code, rename): `rename` is an (old, new) identifier pair, the edit an
instruction asks for."""

from __future__ import annotations

INVENTORY_PY = '''"""A small inventory service: items, stock movements and a report."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime


class StockError(ValueError):
    """A movement that would leave the stock below zero."""


@dataclass
class Item:
    sku: str
    name: str
    price: float
    quantity: int = 0
    tags: list[str] = field(default_factory=list)

    def value(self) -> float:
        return self.price * self.quantity


@dataclass
class Movement:
    sku: str
    change: int
    reason: str
    when: datetime


class Inventory:
    def __init__(self) -> None:
        self.items: dict[str, Item] = {}
        self.history: list[Movement] = []

    def add_item(self, sku: str, name: str, price: float, tags=None) -> Item:
        if sku in self.items:
            raise KeyError(f"item {sku} exists already")
        item = Item(sku, name, price, 0, list(tags or []))
        self.items[sku] = item
        return item

    def receive(self, sku: str, count: int, reason: str = "delivery") -> int:
        if count <= 0:
            raise ValueError("count must be positive")
        return self._move(sku, count, reason)

    def ship(self, sku: str, count: int, reason: str = "order") -> int:
        if count <= 0:
            raise ValueError("count must be positive")
        return self._move(sku, -count, reason)

    def _move(self, sku: str, change: int, reason: str) -> int:
        item = self.items[sku]
        if item.quantity + change < 0:
            raise StockError(f"only {item.quantity} of {sku} left")
        item.quantity += change
        self.history.append(Movement(sku, change, reason, datetime.now()))
        return item.quantity

    def total_value(self) -> float:
        return sum(item.value() for item in self.items.values())

    def low_stock(self, threshold: int = 5) -> list[Item]:
        return sorted((i for i in self.items.values() if i.quantity < threshold),
                      key=lambda i: i.quantity)

    def by_tag(self, tag: str) -> list[Item]:
        return [i for i in self.items.values() if tag in i.tags]

    def movements_of(self, sku: str) -> list[Movement]:
        return [m for m in self.history if m.sku == sku]

    def report(self) -> str:
        lines = [f"{'SKU':<10}{'NAME':<24}{'QTY':>6}{'VALUE':>12}"]
        for item in sorted(self.items.values(), key=lambda i: i.sku):
            lines.append(f"{item.sku:<10}{item.name:<24}{item.quantity:>6}"
                         f"{item.value():>12.2f}")
        lines.append(f"{'TOTAL':<40}{self.total_value():>12.2f}")
        return "\\n".join(lines)

    def save(self, path: str) -> None:
        data = {"items": [vars(i) for i in self.items.values()]}
        with open(path, "w") as f:
            json.dump(data, f, indent=2)

    @classmethod
    def load(cls, path: str) -> "Inventory":
        inv = cls()
        with open(path) as f:
            data = json.load(f)
        for raw in data["items"]:
            item = Item(**raw)
            inv.items[item.sku] = item
        return inv


def main() -> None:
    inv = Inventory()
    inv.add_item("A100", "Blue pen", 1.20, ["office"])
    inv.add_item("B200", "Notebook", 3.50, ["office", "paper"])
    inv.add_item("C300", "Desk lamp", 24.00, ["furniture"])
    inv.receive("A100", 120)
    inv.receive("B200", 40)
    inv.receive("C300", 4)
    inv.ship("A100", 30)
    inv.ship("B200", 38)
    print(inv.report())
    for item in inv.low_stock():
        print(f"reorder {item.sku}: {item.quantity} left")


if __name__ == "__main__":
    main()
'''

EVENTS_JS = '''// A tiny event bus with typed listeners, once-listeners and a debounced emitter.

class EventBus {
  constructor() {
    this.listeners = new Map();
    this.history = [];
  }

  on(name, handler) {
    if (typeof handler !== "function") {
      throw new TypeError("handler must be a function");
    }
    if (!this.listeners.has(name)) {
      this.listeners.set(name, []);
    }
    this.listeners.get(name).push({ handler, once: false });
    return () => this.off(name, handler);
  }

  once(name, handler) {
    this.on(name, handler);
    const list = this.listeners.get(name);
    list[list.length - 1].once = true;
  }

  off(name, handler) {
    const list = this.listeners.get(name);
    if (!list) {
      return false;
    }
    const index = list.findIndex((entry) => entry.handler === handler);
    if (index >= 0) {
      list.splice(index, 1);
    }
    return index >= 0;
  }

  emit(name, payload) {
    const list = this.listeners.get(name) || [];
    this.history.push({ name, payload, at: Date.now() });
    for (const entry of [...list]) {
      entry.handler(payload);
      if (entry.once) {
        this.off(name, entry.handler);
      }
    }
    return list.length;
  }

  count(name) {
    return (this.listeners.get(name) || []).length;
  }

  clear() {
    this.listeners.clear();
    this.history = [];
  }
}

function debounce(fn, waitMs) {
  let timer = null;
  return function debounced(...args) {
    if (timer !== null) {
      clearTimeout(timer);
    }
    timer = setTimeout(() => {
      timer = null;
      fn.apply(this, args);
    }, waitMs);
  };
}

function throttle(fn, intervalMs) {
  let last = 0;
  return function throttled(...args) {
    const now = Date.now();
    if (now - last >= intervalMs) {
      last = now;
      fn.apply(this, args);
    }
  };
}

function createStore(bus, initial) {
  let state = { ...initial };
  return {
    get() {
      return state;
    },
    set(patch) {
      const previous = state;
      state = { ...state, ...patch };
      bus.emit("change", { previous, state });
    },
    reset() {
      state = { ...initial };
      bus.emit("reset", state);
    },
  };
}

const bus = new EventBus();
const store = createStore(bus, { count: 0, user: null });
const log = debounce((event) => console.log("changed", event.state), 50);

bus.on("change", log);
bus.once("reset", () => console.log("store was reset"));
store.set({ count: 1 });
store.set({ user: "ada" });
store.reset();
console.log("listeners:", bus.count("change"), "events:", bus.history.length);

module.exports = { EventBus, debounce, throttle, createStore };
'''

RING_GO = '''package ring

import (
	"errors"
	"fmt"
	"sync"
)

// ErrEmpty is returned when reading from an empty buffer.
var ErrEmpty = errors.New("ring: buffer is empty")

// Buffer is a fixed-size ring buffer of integers, safe for concurrent use.
type Buffer struct {
	mu       sync.Mutex
	data     []int
	head     int
	size     int
	capacity int
	dropped  int
}

// New returns a buffer that holds at most capacity values.
func New(capacity int) *Buffer {
	if capacity <= 0 {
		panic("ring: capacity must be positive")
	}
	return &Buffer{data: make([]int, capacity), capacity: capacity}
}

// Push adds a value, overwriting the oldest one when the buffer is full.
func (b *Buffer) Push(value int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	tail := (b.head + b.size) % b.capacity
	b.data[tail] = value
	if b.size == b.capacity {
		b.head = (b.head + 1) % b.capacity
		b.dropped++
		return
	}
	b.size++
}

// Pop removes and returns the oldest value.
func (b *Buffer) Pop() (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.size == 0 {
		return 0, ErrEmpty
	}
	value := b.data[b.head]
	b.head = (b.head + 1) % b.capacity
	b.size--
	return value, nil
}

// Peek returns the oldest value without removing it.
func (b *Buffer) Peek() (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.size == 0 {
		return 0, ErrEmpty
	}
	return b.data[b.head], nil
}

// Len returns the number of values held.
func (b *Buffer) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.size
}

// Dropped returns how many values were overwritten before being read.
func (b *Buffer) Dropped() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.dropped
}

// Values returns the held values, oldest first.
func (b *Buffer) Values() []int {
	b.mu.Lock()
	defer b.mu.Unlock()
	out := make([]int, 0, b.size)
	for i := 0; i < b.size; i++ {
		out = append(out, b.data[(b.head+i)%b.capacity])
	}
	return out
}

// Sum returns the sum of the held values.
func (b *Buffer) Sum() int {
	total := 0
	for _, v := range b.Values() {
		total += v
	}
	return total
}

// Mean returns the mean of the held values, or an error when there are none.
func (b *Buffer) Mean() (float64, error) {
	values := b.Values()
	if len(values) == 0 {
		return 0, ErrEmpty
	}
	return float64(b.Sum()) / float64(len(values)), nil
}

// String formats the buffer for debugging.
func (b *Buffer) String() string {
	return fmt.Sprintf("ring(%d/%d, dropped %d): %v", b.Len(), b.capacity, b.Dropped(),
		b.Values())
}
'''

SOURCES = (
    ("inventory.py", "python", INVENTORY_PY, ("Inventory", "Warehouse")),
    ("events.js", "javascript", EVENTS_JS, ("EventBus", "Emitter")),
    ("ring.go", "go", RING_GO, ("Buffer", "Ring")),
)
