"""The chunk store: chunk payloads per tier and the DEVICE pool with its hard byte budget.

Every (chunk list, chunk) has at most one payload per tier, each in an explicit `CopyState`
changed only through `ChunkStore._move` (a guarded transition). The store never decides anything:
the runtime calls it once per schedule action and it raises `ExecutorError` when the action is
impossible (a copy from a tier holding no valid copy, an allocation beyond the DEVICE budget...).

DEVICE is the GPU when there is one (HOST payloads pinned). On a CPU-only machine DEVICE is
emulated: a CPU pool whose capacity is the schedule's DEVICE budget (a hard limit). Either way the
DEVICE<->HOST copies go through the copy engine (executor/copies.py) and HOST<->NVME ones through
`executor.nvme.NvmeStore`; a `Ready` travels with every in-flight buffer.

A CPU optimizer step overlapped with backward writes HOST payloads in place on the engine's
optimizer worker (`in_place`): its completion is a `Ready` like a copy's, carried by the payloads it
writes (ARRIVING) and reads (users), so every later copy, wait or EVICT of them is ordered after it.

An EVICT does not wait for the copies still reading the payload (Note [retiring payloads]).
"""

from __future__ import annotations

import enum
import functools
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from executor.copies import CpuCopyEngine, CudaCopyEngine, Ready
from executor.dtypes import TORCH_DTYPES
from executor.errors import ExecutorError
from executor.nvme import NvmeStore, aligned_empty
from schemas.schedule import COPY_CHANNEL, TIERS, Channel, ChunkLayout, ChunkList, Tier

class CopyState(enum.Enum):
    """State of one chunk payload on one tier."""

    ABSENT = "absent"  # no payload (start, or after EVICT)
    ARRIVING = "arriving"  # payload allocated, a copy (or a CPU optimizer step) writing it is in flight (`ready`)
    VALID = "valid"  # payload holds the chunk's current data
    STALE = "stale"  # payload kept, but an OPTIMIZER_STEP on another tier made newer data there
    # EVICTed while copies (or an in-place step) still read its buffer, or a copy still writes it: the
    # schedule sees no copy here, the buffer and its bytes stay in the pool until they land (Note
    # [retiring payloads]); then ABSENT, or VALID again when recover() finds a write-back from it failed
    RETIRING = "retiring"


# allowed transitions; anything else is a schedule that contradicts itself (or an executor bug)
_TRANSITIONS: dict[CopyState, frozenset[CopyState]] = {
    CopyState.ABSENT: frozenset({CopyState.ARRIVING, CopyState.VALID}),
    CopyState.ARRIVING: frozenset({CopyState.VALID, CopyState.ABSENT, CopyState.RETIRING}),
    CopyState.VALID: frozenset({CopyState.ABSENT, CopyState.STALE, CopyState.ARRIVING, CopyState.RETIRING}),
    CopyState.STALE: frozenset({CopyState.ABSENT, CopyState.ARRIVING, CopyState.VALID, CopyState.RETIRING}),
    CopyState.RETIRING: frozenset({CopyState.ABSENT, CopyState.VALID}),
}


# Note [retiring payloads]
# EVICT on DEVICE or HOST never blocks the training thread on the copies in flight: the payload goes
# RETIRING and its buffer is handed to the pool with the `Ready`s of everything still reading it (a
# WRITE_BACK, a copy to another tier, a CPU optimizer step reading its GRAD) or writing it (its own
# incoming copy) -- events travel with their buffers (DESIGN.md §8). Its bytes stay counted against
# the tier's capacity until they land (`Pool.retiring_bytes`), and the pool gives them back to its
# cache only then. That is the simulator's and the planner's rule (Note [simulator evictions] in
# planner/sim_actions.py, Note [offloads in flight] in planner/decisions.py): on a GPU the copy engine
# records the source on its stream and PyTorch's caching allocator hands the memory out only after the
# copy's event (c10/cuda/CUDACachingAllocator.cpp `synchronize_and_free_events`). An allocation (or the
# engine's per-moment budget check) that would go over the capacity with them waits for the oldest
# retiring buffers (and the oldest activation offloads in flight, `Pool.oldest_other`), counted as stall
# seconds (`Pool.make_room`); only bytes that still do not fit once nothing is left in flight raise
# "DEVICE budget exceeded". A copy or ALLOCATE into a payload that is still RETIRING reuses its buffer
# after its readers landed (a wait on the training thread, as for a STALE payload's readers). The end
# of an iteration (`engine.step()`, `land_evicted`) waits for what is still retiring, as the simulator's
# iteration ends with its last copy, so a failed write-back is raised in the iteration that issued it.
# Crash consistency: a RETIRING buffer whose write-back fails still holds the chunk's data. The pool
# never reuses a buffer one of whose readers failed, and `recover()` turns such a payload back into
# VALID (unless newer data exists elsewhere: it was STALE when evicted, or an update came after, or its
# own incoming copy failed), so the failed copy loses no last valid copy; a RETIRING payload whose
# copies all landed becomes ABSENT. NVME payloads (file slots), and payloads an optimizer step is still
# writing, are evicted as before, after what is in flight on them. HOST has no capacity: nothing waits
# for its retiring bytes, and its peak counts in-use bytes only (the simulator frees HOST copies as issued).


@dataclass(slots=True)
class Payload:
    """One chunk's buffer on one tier and its state."""

    state: CopyState = CopyState.ABSENT
    tensor: torch.Tensor | None = None
    ready: Ready | None = None  # the copy (or in-place step) writing `tensor`, while ARRIVING
    readers: list[Ready] = field(default_factory=list)  # copies reading `tensor` still in flight
    users: list[Ready] = field(default_factory=list)  # in-place steps reading `tensor` (GRAD) still in flight
    # while ARRIVING from an in-place step: True, and the copy that was still writing `tensor` before it
    # (a failed step leaves the data it found; a failed copy leaves nothing usable)
    stepping: bool = False
    copy_before_step: Ready | None = None
    # while RETIRING: True when newer data exists on another tier (it was STALE when evicted, or an
    # optimizer step elsewhere came after), so a failed write-back from it does not make it VALID again
    superseded: bool = False


@dataclass(slots=True)
class _Retiring:
    """A freed buffer something in flight still reads or writes (`after`); reused once all have ended."""

    tensor: torch.Tensor
    after: list[Ready]
    what: str  # what the buffer held, for the error when a copy reading it failed ("GRAD chunk 3 on DEVICE")
    on_retired: Callable[[], None] | None  # called (training thread) when the pool takes the buffer back


class Pool:
    """Buffers of one tier. DEVICE has a hard capacity: going over it is a bug, raised loudly.

    Freed buffers are cached by (dtype, numel) and reused, because chunks have few sizes and
    re-faulting fresh pages every fetch would cost as much as the copy itself; cached bytes
    are dropped before in-use plus cached bytes would exceed the capacity. A buffer freed while
    copies still read it is RETIRING: its bytes count against the capacity until they land (Note
    [retiring payloads]).
    """

    def __init__(self, tier: Tier, *, capacity_bytes: int | None, device: torch.device, pin: bool,
                 aligned: bool = False) -> None:
        self.tier, self.capacity_bytes, self.device, self.pin = tier, capacity_bytes, device, pin
        self.aligned = aligned  # 4096-aligned buffers: O_DIRECT reads and writes land without a staging copy
        self.in_use_bytes = 0  # buffers of payloads that hold a copy (VALID, ARRIVING, STALE)
        self.retiring_bytes = 0  # freed buffers whose copies in flight have not landed: still held
        # of held_bytes on DEVICE, of in_use_bytes elsewhere: the simulator keeps an evicted DEVICE copy's
        # bytes until its copies land and frees HOST and NVME ones as issued (Note [simulator evictions])
        self.peak_bytes = 0
        self.stall_seconds = 0.0  # the training thread waiting for in-flight bytes to land (`make_room`)
        # bytes held outside the pool that count against its capacity (DEVICE: the live activations,
        # their offloads in flight included) and the oldest of those still in flight: (its issue time in
        # perf_counter_ns, a call that waits for it landing and returns the seconds waited), or None
        self.other_bytes: Callable[[], int] = lambda: 0
        self.oldest_other: Callable[[], tuple[int, Callable[[], float]] | None] = lambda: None
        self._cache: dict[tuple[torch.dtype, int], list[torch.Tensor]] = defaultdict(list)
        self._cached_bytes = 0
        # freed buffers something in flight still reads or writes, oldest first: they join the cache only
        # once that has ended (and never when a copy reading them failed: `recover` decides), so no
        # allocation hands them out before
        self._retiring: list[tuple[int, _Retiring]] = []

    @property
    def held_bytes(self) -> int:
        """Bytes the tier holds for the store: in use plus retiring."""
        return self.in_use_bytes + self.retiring_bytes

    def _peak(self) -> None:
        self.peak_bytes = max(self.peak_bytes, self.held_bytes if self.tier is Tier.DEVICE else self.in_use_bytes)

    def make_room(self, nbytes: int) -> bool:
        """Whether `nbytes` more fit the capacity with what is held, waiting first (oldest first) for
        retiring buffers and activation offloads in flight while they do not; False only when nothing
        is left in flight to wait for. A failed copy found on the way raises `ExecutorError`."""
        self._harvest()
        if self.capacity_bytes is None:
            return True
        while self.held_bytes + self.other_bytes() + nbytes > self.capacity_bytes:
            own = self._retiring[0] if self._retiring else None
            theirs = self.oldest_other()
            if own is None and theirs is None:
                return False
            if theirs is None or (own is not None and own[0] <= theirs[0]):
                self.stall_seconds += self._wait(own[1])
            else:
                self.stall_seconds += theirs[1]()
            self._harvest()
        return True

    def land(self) -> None:
        """Wait until every retiring buffer's operations have ended (stall seconds); a failed copy raises."""
        for _, entry in list(self._retiring):
            self.stall_seconds += self._wait(entry)
        self._harvest()

    def allocate(self, dtype: torch.dtype, numel: int, *, what: str) -> torch.Tensor:
        nbytes = numel * _itemsize(dtype)
        if not self.make_room(nbytes):
            other = self.other_bytes()
            raise ExecutorError(
                f"{self.tier.value} budget exceeded: {what} needs {nbytes} bytes, {self.held_bytes} chunk bytes + "
                f"{other} activation bytes of {self.capacity_bytes} are in use; the schedule does not fit its own budget (re-solve it "
                f"with `python -m planner solve`, and check it with `python -m planner simulate`)")
        cached = self._cache.get((dtype, numel))
        if cached:
            tensor = cached.pop()
            self._cached_bytes -= nbytes
        else:
            if self.capacity_bytes is not None:
                self._trim(self.capacity_bytes - self.held_bytes - nbytes)
            try:
                tensor = _empty(numel, dtype, device=self.device, pin=self.pin, aligned=self.aligned)
            except torch.OutOfMemoryError as exc:  # the budget promised memory the device does not have
                self._trim(0)  # the cached buffers go first; the caller's failure path settles the rest
                raise out_of_memory(what, nbytes, self.device, exc) from exc
        self.in_use_bytes += nbytes
        self._peak()
        return tensor

    def free(self, tensor: torch.Tensor, *, after: list[Ready] | None = None, what: str = "a buffer",
             on_retired: Callable[[], None] | None = None) -> None:
        """The buffer leaves its payload now; with `after`, it is RETIRING: its bytes stay held and it is
        reused only once those in-flight operations on it have ended (then `on_retired()`)."""
        nbytes = tensor.numel() * tensor.element_size()
        self.in_use_bytes -= nbytes
        if after:
            self.retiring_bytes += nbytes
            self._retiring.append((time.perf_counter_ns(), _Retiring(tensor=tensor, after=list(after), what=what,
                                                                      on_retired=on_retired)))
            return
        self._cache_buffer(tensor)

    def reclaim(self, tensor: torch.Tensor) -> None:
        """A retiring buffer goes back into use (its payload holds data again)."""
        self._take(tensor)
        self.in_use_bytes += tensor.numel() * tensor.element_size()
        self._peak()

    def _take(self, tensor: torch.Tensor) -> None:
        for i, (_, entry) in enumerate(self._retiring):
            if entry.tensor is tensor:
                del self._retiring[i]
                self.retiring_bytes -= tensor.numel() * tensor.element_size()
                return
        raise ExecutorError(f"internal error: a {self.tier.value} buffer is not retiring")

    def _cache_buffer(self, tensor: torch.Tensor) -> None:
        self._cache[(tensor.dtype, tensor.numel())].append(tensor)
        self._cached_bytes += tensor.numel() * tensor.element_size()
        if self.capacity_bytes is not None:
            self._trim(self.capacity_bytes - self.held_bytes)

    def _wait(self, entry: _Retiring) -> float:
        """Block until a retiring buffer's operations have ended; a failed copy reading it raises."""
        waited = 0.0
        for ready in entry.after:
            try:
                waited += ready.wait()
            except ExecutorError:
                raise
            except Exception as exc:  # noqa: BLE001 - one clear line; the buffer stays retiring for recover()
                raise ExecutorError(f"a copy reading {entry.what} failed after its EVICT: {type(exc).__name__}: "
                                    f"{exc}; its buffer is not reused (the engine's recovery keeps it as the "
                                    "chunk's valid copy when the failed copy was its write-back)") from exc
        return waited

    def _harvest(self) -> None:
        if not self._retiring:
            return
        still = []
        for stamp, entry in self._retiring:
            if all(r.done() for r in entry.after) and all(_succeeded(r) for r in entry.after):
                self.retiring_bytes -= entry.tensor.numel() * entry.tensor.element_size()
                self._cache_buffer(entry.tensor)
                if entry.on_retired is not None:
                    entry.on_retired()
            else:
                still.append((stamp, entry))
        self._retiring = still

    def _trim(self, keep_bytes: int) -> None:
        for key in list(self._cache):
            bucket = self._cache[key]
            while bucket and self._cached_bytes > max(keep_bytes, 0):
                tensor = bucket.pop()
                self._cached_bytes -= tensor.numel() * tensor.element_size()


class ChunkStore:
    """Payloads of every (chunk list, chunk) on every tier, with byte counters per channel."""

    def __init__(self, layout: ChunkLayout, *, device_capacity_bytes: int, device: torch.device,
                 nvme: NvmeStore | None = None) -> None:
        self.layout = layout
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.nvme = nvme  # executor.nvme.NvmeStore when the schedule uses the NVME tier
        self.pools = {
            Tier.DEVICE: Pool(Tier.DEVICE, capacity_bytes=device_capacity_bytes, device=device, pin=False),
            Tier.HOST: Pool(Tier.HOST, capacity_bytes=None, device=torch.device("cpu"), pin=self.on_gpu,
                            aligned=nvme is not None),
        }
        self.copies = CudaCopyEngine(device) if self.on_gpu else CpuCopyEngine()
        self.dtypes = {lst: TORCH_DTYPES[layout.list_dtypes[lst]] for lst in layout.lists}
        self._payloads: dict[tuple[ChunkList, int, Tier], Payload] = defaultdict(Payload)
        self.bytes_per_channel: dict[Channel, int] = defaultdict(int)
        self._stall_seconds = 0.0
        # called with (list, chunk, tensor or None) whenever a DEVICE payload appears or goes
        self.on_device_change = lambda lst, chunk, tensor: None

    # -- queries ----------------------------------------------------------------------------
    @property
    def stall_seconds(self) -> float:
        """Seconds the training thread waited for copies: a FETCH's, and in-flight bytes making room."""
        return self._stall_seconds + sum(pool.stall_seconds for pool in self.pools.values())

    def numel(self, chunk: int) -> int:
        return self.layout.chunks[chunk].elements

    def nbytes(self, lst: ChunkList, chunk: int) -> int:
        return self.numel(chunk) * _itemsize(self.dtypes[lst])

    def state(self, lst: ChunkList, chunk: int, tier: Tier) -> CopyState:
        key = (lst, chunk, tier)
        return self._payloads[key].state if key in self._payloads else CopyState.ABSENT

    def valid_tiers(self, lst: ChunkList, chunk: int) -> list[Tier]:
        return [t for t in TIERS if self.state(lst, chunk, t) in (CopyState.VALID, CopyState.ARRIVING)]

    def device_tensor(self, lst: ChunkList, chunk: int) -> torch.Tensor | None:
        """The DEVICE buffer (valid or arriving) or None; no waiting (compute waits via `wait`)."""
        p = self._payloads.get((lst, chunk, Tier.DEVICE))
        return p.tensor if p is not None and p.state in (CopyState.VALID, CopyState.ARRIVING) else None

    def tensor(self, lst: ChunkList, chunk: int, tier: Tier, *, why: str) -> torch.Tensor:
        """A valid payload, waiting for the copy writing it if it is still in flight."""
        p = self._payloads.get((lst, chunk, tier))
        if p is None or p.state not in (CopyState.VALID, CopyState.ARRIVING):
            state = CopyState.ABSENT if p is None else p.state
            raise ExecutorError(f"schedule violation: {why} needs {lst.value} chunk {chunk} on {tier.value}, "
                                f"where it is {state.value}")
        self.wait(lst, chunk, tier)
        return p.tensor

    def wait(self, lst: ChunkList, chunk: int, tier: Tier) -> None:
        p = self._payloads.get((lst, chunk, tier))
        if p is not None and p.state is CopyState.ARRIVING:
            if self.on_gpu and tier is Tier.DEVICE:
                p.ready.wait_on_device()  # GPU work after this point waits; the host goes on
            else:
                self._stall_seconds += p.ready.wait()
            self._move(p, lst, chunk, tier, CopyState.VALID)
            p.ready = None

    def settle(self) -> None:
        """Let every in-flight copy land (end of the run, before state is read)."""
        for (lst, chunk, tier), p in list(self._payloads.items()):
            if p.state is CopyState.RETIRING:
                self._reclaim(p, lst, chunk, tier)  # ABSENT, its buffer back in use: free it
                self.pools[tier].free(p.tensor)
                p.tensor = None
                continue
            self.wait(lst, chunk, tier)
            self._drain_readers(p)
        if self.nvme is not None:
            self.nvme.wait()

    def land_evicted(self) -> None:
        """The end of an iteration: the copies still reading evicted buffers land, as the simulator's
        iteration ends with its last copy (Note [retiring payloads]); a failed one raises ExecutorError,
        and its buffer stays for `recover`."""
        for pool in self.pools.values():
            pool.land()

    def in_place(self, chunk: int, tier: Tier, *, writes: list[ChunkList], reads: list[ChunkList],
                 submit: Callable[[Callable[[], None]], Future],
                 run: Callable[[dict[ChunkList, torch.Tensor]], None]) -> Ready:
        """Start an in-place operation (a CPU optimizer step) on `chunk`'s payloads on `tier`, off the
        training thread: `run(tensors)` is handed to `submit` (the optimizer worker) and first waits,
        there, for the copies still writing its inputs or reading the old values of what it writes.

        Its completion travels with the payloads: each written one is ARRIVING with it (a copy from
        it, `wait`, `tensor`, an EVICT wait for it, like for an incoming copy); each read one lists
        it among its users (an EVICT returns the buffer to the pool only after it, without waiting).
        """
        tensors: dict[ChunkList, torch.Tensor] = {}
        before: list[Ready] = []
        for lst in (*writes, *reads):
            p = self._payloads.get((lst, chunk, tier))
            if p is None or p.state not in (CopyState.VALID, CopyState.ARRIVING):
                state = CopyState.ABSENT if p is None else p.state
                raise ExecutorError(f"schedule violation: the optimizer step of chunk {chunk} on {tier.value} needs "
                                    f"{lst.value} chunk {chunk} there, where it is {state.value}")
            tensors[lst] = p.tensor
            if p.state is CopyState.ARRIVING:
                before.append(p.ready)
            if lst in writes:  # a write-back still reading the old values lands first
                before.extend(p.readers)
                before.extend(p.users)

        def job() -> None:
            for ready in before:
                ready.wait()
            run(tensors)

        ready = Ready(future=submit(job))
        for lst in writes:
            p = self._payloads[(lst, chunk, tier)]
            p.readers.clear()  # the step waits for them: waiting for the step is waiting for them
            p.users.clear()
            if p.state is CopyState.VALID:
                self._move(p, lst, chunk, tier, CopyState.ARRIVING)
            elif not p.stepping:
                p.copy_before_step = p.ready
            p.ready, p.stepping = ready, True
        for lst in reads:
            self._payloads[(lst, chunk, tier)].users.append(ready)
        return ready

    # -- actions ----------------------------------------------------------------------------
    def place(self, lst: ChunkList, chunk: int, tier: Tier, data: torch.Tensor | None) -> None:
        """Attach time: a VALID payload on `tier` filled from `data` (zeros where None)."""
        p = self._payloads[(lst, chunk, tier)]
        if tier is Tier.NVME:
            self._require_nvme(lst, chunk)
            if data is None:
                data = torch.zeros(self.numel(chunk), dtype=self.dtypes[lst])
            self.nvme.write(lst, chunk, data.to(self.dtypes[lst]).contiguous())
            self._move(p, lst, chunk, tier, CopyState.VALID)
            return
        self._reclaim(p, lst, chunk, tier)
        tensor = p.tensor if p.tensor is not None else self.pools[tier].allocate(
            self.dtypes[lst], self.numel(chunk), what=f"{lst.value} chunk {chunk}")
        if data is None:
            tensor.zero_()
        else:
            tensor.copy_(data)
        p.tensor = tensor
        self._move(p, lst, chunk, tier, CopyState.VALID)
        if tier is Tier.DEVICE:
            self.on_device_change(lst, chunk, tensor)

    def copy(self, lst: ChunkList, chunk: int, src: Tier, dst: Tier, channel: Channel, *, why: str,
             counter: dict[Channel, int] | None = None) -> int:
        """FETCH / PREFETCH / WRITE_BACK: start a copy src -> dst; returns the bytes moved (counted in
        `bytes_per_channel`, or in `counter`: an evaluation's copies are kept apart from the iterations')."""
        expected = COPY_CHANNEL.get((src, dst))  # NVME copies go through executor/nvme.py
        if expected is None or expected is not channel:
            raise ExecutorError(f"schedule violation: {why} copies {src.value} -> {dst.value} on channel "
                                f"{channel.value}; this executor copies that pair on {expected}")
        s = self._payloads.get((lst, chunk, src))
        if s is None or s.state not in (CopyState.VALID, CopyState.ARRIVING):
            raise ExecutorError(f"schedule violation: {why} copies {lst.value} chunk {chunk} from {src.value}, "
                                f"which holds no valid copy ({(s.state if s else CopyState.ABSENT).value})")
        d = self._payloads[(lst, chunk, dst)]
        if d.state is CopyState.VALID or d.state is CopyState.ARRIVING:
            raise ExecutorError(f"schedule violation: {why} copies {lst.value} chunk {chunk} to {dst.value}, "
                                f"which already holds a valid copy")
        reclaimed = self._reclaim(d, lst, chunk, dst)
        if d.tensor is None and dst is not Tier.NVME:
            d.tensor = self.pools[dst].allocate(self.dtypes[lst], self.numel(chunk), what=f"{why} ({lst.value} chunk {chunk})")
            if dst is Tier.DEVICE:
                self.on_device_change(lst, chunk, d.tensor)
        elif reclaimed and dst is Tier.DEVICE:
            self.on_device_change(lst, chunk, d.tensor)
        self._drain_readers(d)  # a stale payload may still be read by an earlier copy
        after = [s.ready] if s.state is CopyState.ARRIVING else []
        if Tier.NVME in (src, dst):
            self._require_nvme(lst, chunk)
            if dst is Tier.NVME:  # only the schedule's WRITE_BACKs write: dirty chunks only
                ready = Ready(future=self.nvme.write_async(lst, chunk, s.tensor, after=after))
            else:
                ready = Ready(future=self.nvme.read_async(lst, chunk, d.tensor, after=after))
        elif self.on_gpu:
            ready = self.copies.copy(d.tensor, s.tensor, after=after, channel=channel)
        else:
            ready = self.copies.copy(d.tensor, s.tensor, after=after)
        s.readers.append(ready)
        d.ready = ready
        self._move(d, lst, chunk, dst, CopyState.ARRIVING)
        nbytes = self.nbytes(lst, chunk)
        (self.bytes_per_channel if counter is None else counter)[channel] += nbytes
        return nbytes

    def allocate(self, lst: ChunkList, chunk: int, tier: Tier, *, why: str, zero: bool = True) -> None:
        """ALLOCATE: a zero-filled VALID payload on `tier` (zero=False: the caller fills every element
        before anything reads the chunk)."""
        p = self._payloads[(lst, chunk, tier)]
        if p.state in (CopyState.VALID, CopyState.ARRIVING):
            raise ExecutorError(f"schedule violation: {why} allocates {lst.value} chunk {chunk} on {tier.value}, "
                                f"which already holds it")
        self._reclaim(p, lst, chunk, tier)
        if p.tensor is None:
            p.tensor = self.pools[tier].allocate(self.dtypes[lst], self.numel(chunk), what=f"{why} ({lst.value} chunk {chunk})")
        self._drain_readers(p)
        if zero:
            p.tensor.zero_()
        self._move(p, lst, chunk, tier, CopyState.VALID)
        if tier is Tier.DEVICE:
            self.on_device_change(lst, chunk, p.tensor)

    def evict(self, lst: ChunkList, chunk: int, tier: Tier, *, why: str) -> None:
        """EVICT: drop the payload. On DEVICE and HOST the training thread goes on: a buffer still read
        (or written) by copies in flight is RETIRING until they land (Note [retiring payloads])."""
        p = self._payloads.get((lst, chunk, tier))
        if p is None or p.state in (CopyState.ABSENT, CopyState.RETIRING):
            raise ExecutorError(f"schedule violation: {why} evicts {lst.value} chunk {chunk} from {tier.value}, "
                                f"which does not hold it")
        if p.state is CopyState.ARRIVING and (p.stepping or p.tensor is None):
            # an optimizer step still writing it (its failure path needs the payload), or an NVME file
            # slot still being written: the eviction waits for it, as before
            self._stall_seconds += p.ready.wait()
            self._move(p, lst, chunk, tier, CopyState.VALID)
            p.ready = None
        in_flight = [*([p.ready] if p.state is CopyState.ARRIVING else []), *p.readers, *p.users]
        if in_flight and p.tensor is not None:
            if tier is Tier.DEVICE:
                self.on_device_change(lst, chunk, None)
            key, tensor = (lst, chunk, tier), p.tensor
            p.superseded = p.state is CopyState.STALE
            self._move(p, lst, chunk, tier, CopyState.RETIRING)
            self.pools[tier].free(tensor, after=in_flight, what=f"{lst.value} chunk {chunk} on {tier.value}",
                                  on_retired=functools.partial(self._retired, key, tensor))
            return
        self._drain_readers(p)  # an NVME file slot: its readers land first
        p.ready = None
        self._free(p, lst, chunk, tier)

    def mark_stale(self, lst: ChunkList, chunk: int, tier: Tier) -> None:
        """A payload goes back to STALE (an evaluation refreshed a stale copy it then gives back)."""
        self.wait(lst, chunk, tier)
        self._move(self._payloads[(lst, chunk, tier)], lst, chunk, tier, CopyState.STALE)

    def updated(self, lst: ChunkList, chunk: int, tier: Tier) -> None:
        """The payload on `tier` was written in place (optimizer step): copies elsewhere are stale.

        Every other copy is marked before a failed one is raised, so no old copy is left VALID."""
        failure: Exception | None = None
        for other in TIERS:
            if other is not tier and self.state(lst, chunk, other) is CopyState.RETIRING:
                self._payloads[(lst, chunk, other)].superseded = True  # never VALID again
                continue
            if other is not tier and self.state(lst, chunk, other) is not CopyState.ABSENT:
                try:
                    self.wait(lst, chunk, other)  # an ARRIVING copy lands (VALID) before it goes stale
                except Exception as exc:  # noqa: BLE001 - the copy failed: its payload holds nothing usable
                    failure = failure or exc
                    self._drop(lst, chunk, other)
                    continue
                self._move(self._payloads[(lst, chunk, other)], lst, chunk, other, CopyState.STALE)
        if failure is not None:
            raise failure

    def recover(self) -> list[tuple[ChunkList, int]]:
        """After a failed copy: every copy in flight lands or fails; a payload whose copy failed is
        dropped (ABSENT; a failed NVME write leaves the chunk in memory, where it was never evicted).
        A RETIRING payload whose write-back (or other copy reading it) failed is VALID again: its buffer
        still holds the data (Note [retiring payloads]); one whose copies landed is ABSENT.
        Returns the (list, chunk) pairs that held data and now have no valid copy (nothing should)."""
        had_data = {(lst, chunk) for (lst, chunk, _), p in self._payloads.items()
                    if p.state not in (CopyState.ABSENT, CopyState.RETIRING)}
        for (lst, chunk, tier), p in list(self._payloads.items()):
            if p.state is CopyState.RETIRING:
                self._recover_retiring(p, lst, chunk, tier)
                continue
            if p.state is CopyState.ARRIVING:
                try:
                    p.ready.wait()
                except Exception:  # noqa: BLE001 - reported when it failed; here only its payload goes
                    if p.stepping and _succeeded(p.copy_before_step):
                        # a failed optimizer step: the payload holds what the step left (the engine's
                        # failure names the chunk as stepped, so no checkpoint is taken from it)
                        self._move(p, lst, chunk, tier, CopyState.VALID)
                        p.ready = None
                    else:
                        self._drop(lst, chunk, tier)
                else:
                    self._move(p, lst, chunk, tier, CopyState.VALID)
                    p.ready = None
            for ready in (*p.readers, *p.users):
                try:
                    ready.wait()
                except Exception:  # noqa: BLE001 - a failed read of this payload left it unchanged
                    pass
            p.readers.clear()
            p.users.clear()
        if self.nvme is not None:
            self.nvme.wait()
        return sorted((key for key in had_data if not self.valid_tiers(*key)), key=lambda k: (k[0].value, k[1]))

    def drop_readers(self, lst: ChunkList, chunk: int, tier: Tier) -> None:
        """Before writing a payload in place: the copies still reading its old content must land."""
        p = self._payloads.get((lst, chunk, tier))
        if p is not None:
            self._drain_readers(p)

    def read_nvme(self, lst: ChunkList, chunk: int) -> torch.Tensor:
        """A CPU copy of a chunk that is valid on NVME (state dicts between iterations)."""
        self.wait(lst, chunk, Tier.NVME)
        out = torch.empty(self.numel(chunk), dtype=self.dtypes[lst])
        self.nvme.read(lst, chunk, out)
        return out

    def write_nvme(self, lst: ChunkList, chunk: int, data: torch.Tensor) -> None:
        self.wait(lst, chunk, Tier.NVME)
        self.nvme.write(lst, chunk, data.to(self.dtypes[lst]).contiguous())

    def close(self) -> None:
        self.settle()
        self.copies.close()
        if self.nvme is not None:
            self.nvme.close()  # removes the files

    def _require_nvme(self, lst: ChunkList, chunk: int) -> None:
        if self.nvme is None:
            raise ExecutorError(f"{lst.value} chunk {chunk} goes to NVME but the engine has no NVME store: pass "
                                "nvme_dir= to executor.run")

    # -- internals --------------------------------------------------------------------------
    def _retired(self, key: tuple[ChunkList, int, Tier], tensor: torch.Tensor) -> None:
        """The pool took a RETIRING payload's buffer back (its copies landed): the payload is ABSENT."""
        p = self._payloads.get(key)
        if p is not None and p.state is CopyState.RETIRING and p.tensor is tensor:
            p.tensor, p.ready, p.superseded = None, None, False
            p.readers.clear()
            p.users.clear()
            self._move(p, *key, CopyState.ABSENT)

    def _reclaim(self, p: Payload, lst: ChunkList, chunk: int, tier: Tier) -> bool:
        """A RETIRING payload about to hold data again (a copy or ALLOCATE into it, the end of the run):
        what still reads or writes its buffer lands first (a wait on the training thread), then the
        buffer is the payload's again, ABSENT and ready to be filled. A failed copy raises, and the
        payload stays RETIRING for `recover`."""
        if p.state is not CopyState.RETIRING:
            return False
        pool = self.pools[tier]
        if p.ready is not None:
            self._stall_seconds += p.ready.wait()
        self._drain_readers(p)
        pool.reclaim(p.tensor)
        p.ready, p.superseded = None, False
        self._move(p, lst, chunk, tier, CopyState.ABSENT)
        return True

    def _recover_retiring(self, p: Payload, lst: ChunkList, chunk: int, tier: Tier) -> None:
        """recover() of a RETIRING payload: VALID again when a copy reading it failed and its buffer holds
        the chunk's newest data; else ABSENT, its buffer back in the pool."""
        incoming_ok = _succeeded(p.ready)
        read_failed = [r for r in p.readers if not _succeeded(r)]
        for ready in p.users:  # an in-place step reading it (a GRAD): its own failure is reported by the step
            _succeeded(ready)
        p.readers.clear()
        p.users.clear()
        p.ready = None
        self.pools[tier].reclaim(p.tensor)
        if incoming_ok and read_failed and not p.superseded:
            self._move(p, lst, chunk, tier, CopyState.VALID)
            if tier is Tier.DEVICE:
                self.on_device_change(lst, chunk, p.tensor)
        else:
            self._free(p, lst, chunk, tier)
        p.superseded = False

    def _free(self, p: Payload, lst: ChunkList, chunk: int, tier: Tier) -> None:
        """A payload nothing reads or writes any more: its buffer back to the pool, ABSENT."""
        if tier is Tier.DEVICE:
            self.on_device_change(lst, chunk, None)
        if p.tensor is not None:  # an NVME copy is a file slot: nothing to free
            self.pools[tier].free(p.tensor)
        p.tensor = None
        self._move(p, lst, chunk, tier, CopyState.ABSENT)

    def _drop(self, lst: ChunkList, chunk: int, tier: Tier) -> None:
        """A payload whose incoming copy failed: freed and ABSENT."""
        p = self._payloads[(lst, chunk, tier)]
        p.ready = None
        if tier is Tier.DEVICE:
            self.on_device_change(lst, chunk, None)
        if p.tensor is not None:
            self.pools[tier].free(p.tensor)
        p.tensor = None
        p.state = CopyState.ABSENT  # from ARRIVING (allowed) or VALID whose wait failed
        p.stepping, p.copy_before_step = False, None

    def _drain_readers(self, p: Payload) -> None:
        for ready in (*p.readers, *p.users):
            self._stall_seconds += ready.wait()
        p.readers.clear()
        p.users.clear()

    def _move(self, p: Payload, lst: ChunkList, chunk: int, tier: Tier, to: CopyState) -> None:
        if to not in _TRANSITIONS[p.state]:
            raise ExecutorError(f"internal error: {lst.value} chunk {chunk} on {tier.value} cannot go from "
                                f"{p.state.value} to {to.value}")
        p.state = to
        if to is not CopyState.ARRIVING:
            p.stepping, p.copy_before_step = False, None


def out_of_memory(what: str, nbytes: int | None, device: object, exc: BaseException) -> ExecutorError:
    """`torch.OutOfMemoryError` as one line: what needed the bytes, how many, what the GPU had free, the fix.

    The schedule's DEVICE budget promised that memory: another process on the GPU, fragmentation or a
    budget solved for a larger GPU took it (a real GPU's usable memory is less than its size)."""
    free = ""
    dev = torch.device(device) if not isinstance(device, torch.device) else device
    if dev.type == "cuda":
        try:
            free_bytes, total_bytes = torch.cuda.mem_get_info(dev)
            free = f"; the GPU has {free_bytes / 2**30:.3g} GiB free of {total_bytes / 2**30:.3g} GiB"
        except Exception:  # noqa: BLE001 - the error itself must not fail
            free = ""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    need = f"{nbytes} bytes" if nbytes is not None else "more memory"
    return ExecutorError(f"out of memory on {dev}: {what} needed {need}{free} ({first}); the schedule's "
                         "DEVICE budget is more than this GPU can give: re-solve with a smaller `--device-memory-gb` "
                         "(`python -m planner solve ... --device-memory-gb N`)")


def _empty(numel: int, dtype: torch.dtype, *, device: torch.device, pin: bool, aligned: bool) -> torch.Tensor:
    """A new pool buffer (one place, so tests can inject an out-of-memory error)."""
    if aligned:
        return aligned_empty(numel, dtype, pin_memory=pin)
    return torch.empty(numel, dtype=dtype, device=device, pin_memory=pin)


def _succeeded(ready: Ready | None) -> bool:
    return ready is None or ready.succeeded()


@functools.cache
def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
