"""The activation store: what each (stage, microbatch) forward saved, where it lives, and its bytes.

Every tensor autograd saves during a forward passes through ``saved_tensors_hooks`` while
``capture(stage, microbatch)`` is active. The store groups them by the storage they view (a
block): two saved views of one buffer are one block, counted once, moved once. Parameters and
module buffers are not activations; they pass through untouched.

Counting follows docs/design.md, "Memory holds", so the measured peak can be held against the
simulator's: bytes are added when a forward saves a new block (so the forward's whole
activation is held by its end, as the simulator holds it from the start; nothing frees in
between), ``forget(key, keep)`` at the end of B releases every block the weight pass does not
need, ``drop(key)`` at the end of W or of a fused backward releases the rest. Offload copies a
key's blocks to host buffers and releases the device bytes at ``wait_offload`` (the instant the
copy is known done, which is where the plan's WAIT_OFFLOAD stands); ``reload`` allocates them
again at once (the simulator holds them from the RELOAD's start) and ``wait_reload`` makes
the backward wait for the copy.

Without offload every count happens at a compute instruction, in the device's list order,
so the store's peak equals the simulator's exactly. With offload the store counts a release at
WAIT_OFFLOAD and an allocation at RELOAD, in stream order, while the simulator counts them at
the copy's end and start in time order. They agree when the plan puts each WAIT_OFFLOAD before
the first op (compute or reload) that the simulator starts at or after the copy's end (what
``lower`` does) and each reload starts when it is issued. They can differ when a RELOAD is
issued while the host-to-device channel is still busy with an earlier one: the simulator then
starts it, and takes its memory, later than the stream issues it, so a B or W that ends in
between frees first in the simulator and last here, and the store's peak is the higher one.

Releasing a block empties its storage in place (``resize_(0)``, as FSDP does), so the memory
really returns to the allocator even though autograd's graph, the stage input or a view still
refers to it; reloading refills the same storage, so every view sees its data again. So the
store must never be handed a storage that outlives the step: parameters, buffers and any
other tensor a module keeps (``module_tensors``) are excluded, and the caller's data is
copied before a forward saves it (the interpreter does both).

On CUDA the copies run on their own streams (one device-to-host, one host-to-device, like the
simulator's two channels) into pinned host buffers drawn from a pool that is reused across
iterations, and events order them against compute without blocking the host. On CPU the
same calls copy synchronously into plain host buffers.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

import torch
from torch.autograd.graph import saved_tensors_hooks

__all__ = ["ActivationStore", "HostPool", "StoreStats", "module_tensors"]

Key = tuple[int, int]  # (stage, microbatch)


class HostPool:
    """Host buffers by size, reused across iterations; pinned when the device is a GPU."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[torch.Tensor]] = {}
        self.allocated = 0  # buffers ever created
        self.allocated_bytes = 0
        self.reused = 0  # buffers handed out again

    def take(self, nbytes: int) -> torch.Tensor:
        free = self._free.get(nbytes)
        if free:
            self.reused += 1
            return free.pop()
        self.allocated += 1
        self.allocated_bytes += nbytes
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buffer: torch.Tensor) -> None:
        self._free.setdefault(buffer.numel(), []).append(buffer)


class _Block:
    """One storage holding saved activations."""

    __slots__ = ("storage", "nbytes", "users", "resident", "host")

    def __init__(self, storage: torch.UntypedStorage, nbytes: int):
        self.storage = storage
        self.nbytes = nbytes
        self.users = 1  # entries (stage, microbatch) that saved a view of it
        self.resident = True  # its bytes are on the device
        self.host: torch.Tensor | None = None


class _Saved:
    """What autograd keeps in place of a saved tensor: the tensor and the block it lives in."""

    __slots__ = ("tensor", "block", "index", "key")

    def __init__(self, tensor: torch.Tensor, block: _Block, index: int, key: Key):
        self.tensor = tensor
        self.block = block
        self.index = index  # position among the entry's saved tensors, in pack order
        self.key = key


class _Entry:
    __slots__ = ("key", "blocks", "saved", "bytes", "moving", "event")

    def __init__(self, key: Key):
        self.key = key
        self.blocks: dict[int, _Block] = {}  # id(block) -> block
        self.saved: list[_Saved] = []
        self.bytes = 0  # bytes of the blocks this entry brought in
        self.moving: list[_Block] = []  # blocks of an offload or reload in flight
        self.event = None  # CUDA event that marks the copy done


@dataclass(frozen=True)
class StoreStats:
    resident_bytes: int
    peak_bytes: int
    host_buffers_allocated: int
    host_buffers_reused: int
    host_bytes_allocated: int


def module_tensors(modules: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """Every tensor the modules keep across steps: parameters, buffers and plain tensor attributes."""
    found = []
    for top in modules:
        for module in top.modules():
            found.extend(module.parameters(recurse=False))
            found.extend(module.buffers(recurse=False))
            found.extend(v for v in vars(module).values() if isinstance(v, torch.Tensor))
    return found


def _flat(storage: torch.UntypedStorage) -> torch.Tensor:
    """A byte tensor over a whole storage, for copying it as one piece."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


class ActivationStore:
    """Saved activations of one rank, by (stage, microbatch), with exact device-byte counting."""

    def __init__(self, device: torch.device | str, exclude: Iterable[torch.Tensor] = ()):
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._by_ptr: dict[int, _Block] = {}
        self._entries: dict[Key, _Entry] = {}
        self._current: _Entry | None = None
        self._census: set[int] | None = None
        self.resident = 0
        self.peak = 0
        self.pool = HostPool(pin=self._cuda)
        if self._cuda:
            self._d2h = torch.cuda.Stream(device=self.device)
            self._h2d = torch.cuda.Stream(device=self.device)
        self._hooks = saved_tensors_hooks(self._pack, self._unpack)

    # ----------------------------------------------------------------- capture

    @contextmanager
    def capture(self, stage: int, microbatch: int) -> Iterator[None]:
        """Route every tensor saved inside the block to the (stage, microbatch) entry."""
        key = (stage, microbatch)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key)
        self._current = entry
        try:
            with self._hooks:
                yield
        finally:
            self._current = None

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        entry = self._current
        if entry is None or ptr == 0 or ptr in self._excluded:
            return tensor  # parameters, buffers, empty tensors: not activations
        block = self._by_ptr.get(ptr)
        if block is None:
            block = _Block(storage, storage.nbytes())
            self._by_ptr[ptr] = block
            entry.blocks[id(block)] = block
            entry.bytes += block.nbytes
            self.resident += block.nbytes
            if self.resident > self.peak:
                self.peak = self.resident
        elif id(block) not in entry.blocks:
            block.users += 1
            entry.blocks[id(block)] = block
        # Detached: a saved output carries its own grad_fn, which holds this object through the
        # saved variable: a cycle through C++ that no garbage collector sees, so a graph that B
        # and W retain would never be freed.
        saved = _Saved(tensor.detach(), block, len(entry.saved), entry.key)
        entry.saved.append(saved)
        return saved

    def _unpack(self, packed):
        if type(packed) is not _Saved:
            return packed
        if self._census is not None:
            self._census.add(packed.index)
        if not packed.block.resident:
            stage, microbatch = packed.key
            raise RuntimeError(
                f"the activation of stage {stage} microbatch {microbatch} is not on the device (offloaded or "
                f"released) but the backward needs it: the plan must RELOAD and WAIT_RELOAD it before its "
                f"backward, and a weight pass must not need what B released"
            )
        return packed.tensor

    # ----------------------------------------------------------------- what the weight pass needs

    @contextmanager
    def census(self) -> Iterator[set[int]]:
        """Record the pack positions of every saved tensor unpacked inside the block."""
        seen: set[int] = set()
        self._census = seen
        try:
            yield seen
        finally:
            self._census = None

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether a saved activation lives in this tensor's storage."""
        return tensor.untyped_storage().data_ptr() in self._by_ptr

    def saved_count(self, stage: int, microbatch: int) -> int:
        entry = self._entries.get((stage, microbatch))
        return len(entry.saved) if entry else 0

    def entry_bytes(self, stage: int, microbatch: int) -> int:
        """Device bytes the entry holds now (its own blocks that are resident)."""
        entry = self._entries.get((stage, microbatch))
        if entry is None:
            return 0
        return sum(b.nbytes for b in entry.blocks.values() if b.resident)

    # ----------------------------------------------------------------- release

    def forget(self, stage: int, microbatch: int, keep: frozenset[int] | set[int]) -> int:
        """End of B: release every block that no saved tensor at a ``keep`` position uses.

        The released storages are emptied in place; what W needs stays. Returns bytes released.
        """
        entry = self._entries.get((stage, microbatch))
        if entry is None:
            return 0
        needed = {id(entry.saved[k].block) for k in keep if k < len(entry.saved)}
        released = 0
        for bid in [b for b in entry.blocks if b not in needed]:
            released += self._let_go(entry, entry.blocks.pop(bid), empty=True)
        return released

    def drop(self, stage: int, microbatch: int) -> int:
        """End of W or of a fused backward: the entry is done; its blocks go with the graph."""
        entry = self._entries.pop((stage, microbatch), None)
        if entry is None:
            return 0
        released = 0
        for block in entry.blocks.values():
            released += self._let_go(entry, block, empty=False)
        return released

    def keep(self, stage: int, microbatch: int, tensor: torch.Tensor) -> int:
        """Count ``tensor``'s storage as the entry's (a new entry after ``drop``): what a recomputed
        forward keeps until its recompute, the stage input (semantics: ``[recompute] resident``).
        The recompute saves it again into the same block, so it is counted once; the backward's
        ``forget`` or the weight pass's ``drop`` releases it like any saved block. Returns the
        bytes newly counted (0 when another entry already holds that storage)."""
        key = (stage, microbatch)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry(key)
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0 or ptr in self._excluded:
            return 0
        block = self._by_ptr.get(ptr)
        if block is not None:
            if id(block) not in entry.blocks:
                block.users += 1
                entry.blocks[id(block)] = block
            return 0
        block = self._by_ptr[ptr] = _Block(storage, storage.nbytes())
        entry.blocks[id(block)] = block
        entry.bytes += block.nbytes
        self.resident += block.nbytes
        if self.resident > self.peak:
            self.peak = self.resident
        return block.nbytes

    def _let_go(self, entry: _Entry, block: _Block, empty: bool) -> int:
        block.users -= 1
        if block.users > 0:
            return 0
        freed = 0
        if block.resident:
            self._by_ptr.pop(block.storage.data_ptr(), None)
            block.resident = False
            self.resident -= block.nbytes
            freed = block.nbytes
            if empty:
                block.storage.resize_(0)
        if block.host is not None:
            self.pool.give(block.host)
            block.host = None
        return freed

    # ----------------------------------------------------------------- offload and reload

    def offload(self, stage: int, microbatch: int) -> None:
        """Start copying the entry's blocks to host buffers (D2H); device bytes stay until the wait."""
        entry = self._entry(stage, microbatch, "OFFLOAD")
        # A block another entry also saved (a hand-over between stages on this rank) stays.
        entry.moving = [b for b in entry.blocks.values() if b.resident and b.users == 1]
        for block in entry.moving:
            block.host = self.pool.take(block.nbytes)
        if self._cuda:
            ready = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self._d2h):
                self._d2h.wait_event(ready)
                for block in entry.moving:
                    block.host.copy_(_flat(block.storage), non_blocking=True)
                entry.event = self._d2h.record_event()
        else:
            for block in entry.moving:
                block.host.copy_(_flat(block.storage))

    def wait_offload(self, stage: int, microbatch: int) -> int:
        """The copy is done: release the device bytes. Returns bytes released."""
        entry = self._entry(stage, microbatch, "WAIT_OFFLOAD")
        if self._cuda and entry.event is not None:
            # Compute waits for the copy, so memory reused by later kernels is read first.
            torch.cuda.current_stream(self.device).wait_event(entry.event)
        released = 0
        for block in entry.moving:
            self._by_ptr.pop(block.storage.data_ptr(), None)
            block.storage.resize_(0)
            block.resident = False
            self.resident -= block.nbytes
            released += block.nbytes
        entry.event = None
        return released

    def reload(self, stage: int, microbatch: int) -> None:
        """Allocate the blocks on the device again and start copying them back (H2D)."""
        entry = self._entry(stage, microbatch, "RELOAD")
        for block in entry.moving:
            if block.resident:
                raise RuntimeError(f"RELOAD of stage {stage} microbatch {microbatch} before its WAIT_OFFLOAD")
            block.storage.resize_(block.nbytes)
            self._by_ptr[block.storage.data_ptr()] = block
            block.resident = True
            self.resident += block.nbytes
        if self.resident > self.peak:
            self.peak = self.resident
        if self._cuda:
            allocated = torch.cuda.current_stream(self.device).record_event()
            with torch.cuda.stream(self._h2d):
                self._h2d.wait_event(allocated)
                for block in entry.moving:
                    _flat(block.storage).copy_(block.host, non_blocking=True)
                entry.event = self._h2d.record_event()
        else:
            for block in entry.moving:
                _flat(block.storage).copy_(block.host)

    def wait_reload(self, stage: int, microbatch: int) -> None:
        """The backward may read the blocks now; their host buffers go back to the pool."""
        entry = self._entry(stage, microbatch, "WAIT_RELOAD")
        if self._cuda and entry.event is not None:
            torch.cuda.current_stream(self.device).wait_event(entry.event)
        for block in entry.moving:
            # Safe to hand out again: any later D2H copy into it is ordered after this wait.
            self.pool.give(block.host)
            block.host = None
        entry.moving = []
        entry.event = None

    def _entry(self, stage: int, microbatch: int, what: str) -> _Entry:
        entry = self._entries.get((stage, microbatch))
        if entry is None:
            raise RuntimeError(f"{what} of stage {stage} microbatch {microbatch}: its forward has not run on this rank")
        return entry

    # ----------------------------------------------------------------- reporting

    def reset_peak(self) -> None:
        self.peak = self.resident

    @property
    def live_entries(self) -> int:
        return len(self._entries)

    def stats(self) -> StoreStats:
        return StoreStats(self.resident, self.peak, self.pool.allocated, self.pool.reused, self.pool.allocated_bytes)
