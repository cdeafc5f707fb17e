"""Continuous batching: one worker thread owns the model and the device, and runs requests over a fixed pool of
cache slots; requests join and leave the running batch at token granularity.

Each turn of the worker prefills the waiting requests that fit in free slots (one batched call), then advances
every live slot by one token. Tokens reach each request's `on_token` callback from the worker thread as they are
drawn; the HTTP side hands them to its event loop and never blocks the worker.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

import jax
import numpy as np

from jaxnn.errors import ServerBusyError
from jaxnn.layers import Layer
from jaxnn.precision import Policy, get_policy
from jaxnn.serve.slots import RowSampling, decode, empty_pool, place, prefill, vocabulary

log = logging.getLogger("jaxnn.serve")

MIN_WIDTH = 8  # the narrowest prefill width: shorter prompts share its compiled program


# on_token(token, finish_reason): a new token (finish_reason None while the request goes on; "stop" after its end
# token, "length" at its maximum), or (None, "error: ...") when the device failed.
TokenCallback = Callable[[int | None, str | None], None]


@dataclasses.dataclass(eq=False)
class Request:
    """One generation request: its prompt ids, its limit, end tokens and sampling settings (those of
    `jaxnn.decoding.Sampler`; top_k 0 and top_p 1 restrict nothing)."""

    prompt: list[int]
    max_tokens: int
    on_token: TokenCallback
    stop_ids: frozenset[int] = frozenset()
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    produced: int = 0
    cancelled: bool = False

    @functools.cached_property
    def key_data(self) -> np.ndarray:
        """The request's key (from `seed`, else a fresh one), as jax.random.key_data."""
        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(4), "little")
        return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


class Engine:
    """Serves `Request`s over `slots` cache slots of `context` positions each (a request's prompt and new tokens
    together fit in `context`); at most `max_queue` wait for a slot, at most `max_prefill` join per turn."""

    def __init__(
        self,
        model: Layer,
        params: Any,
        *,
        context: int,
        model_state: Any = None,
        policy: Policy | str = "fp32",
        slots: int = 16,
        max_queue: int = 256,
        max_prefill: int = 8,
    ) -> None:
        if model.init_cache is None:
            raise ValueError(f"serve: model {model.name!r} has no decoding cache (no causal attention layer)")
        for name, value in (
            ("slots", slots),
            ("context", context),
            ("max_queue", max_queue),
            ("max_prefill", max_prefill),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"serve: {name} must be a positive integer, got {value!r}")
        self.model, self.policy = model, get_policy(policy)
        self.params, self.state = self.policy.cast_to_compute(params), model_state
        self.context, self.slots, self.max_queue, self.max_prefill = context, slots, max_queue, max_prefill
        self.vocab = vocabulary(model, self.params, model_state, self.policy)
        self._pool = empty_pool(model, slots, context, self.policy.compute_dtype)
        self._table = _SlotTable(slots)
        self._waiting: collections.deque[Request] = collections.deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._worker = threading.Thread(target=self._serve, name="jaxnn-serve-engine", daemon=True)

    def start(self) -> Engine:
        """Starts the worker thread (requests submitted before wait for it); returns the engine."""
        self._worker.start()
        return self

    def warm_up(self, prompt_lengths: Iterable[int]) -> None:
        """Compiles, before any request arrives, the programs that prompts of these lengths use: the prefill of
        each batch of joining requests (1, 2, 4, ... `max_prefill` rows) at each length's padded width, the copy
        into a slot and the decode step. Call it before `start`: without it the first request of each new width
        or batch size waits for a compile (seconds), which a server's first users, or a benchmark, would see.
        `every_width(n)` lists one length per width that prompts of up to n tokens take."""
        if self._worker.ident is not None:  # started: the worker owns the pool now
            raise RuntimeError("serve: warm_up runs before start()")
        widths = sorted({_bucket(n) if _bucket(n) < self.context else n for n in prompt_lengths})
        for width in widths:
            for rows in _row_buckets(self.max_prefill):
                ids, mask = np.zeros((rows, width), np.int32), np.ones((rows, width), bool)
                _, rows_cache = prefill(self.model, self.policy, self.context, self.params, self.state,
                                        ids, mask, _sampling([], rows))  # fmt: skip
                # A free slot's contents are never read: the next placement overwrites every leaf of it.
                self._pool = place(self._pool, rows_cache, np.int32(0), np.int32(0))
        t = self._table
        sampling = RowSampling(t.temperature, t.top_k, t.top_p, t.key_data, t.count)
        # No slot is live: the step runs and leaves every index at 0.
        _, self._pool = decode(self.model, self.policy, self.params, self.state, self._pool,
                               t.token, t.position, t.live, sampling)  # fmt: skip
        jax.block_until_ready(self._pool)

    def submit(self, request: Request) -> None:
        """Queues `request`; ServerBusyError when `max_queue` are already waiting, ValueError when it cannot fit."""
        if not request.prompt:
            raise ValueError("serve: a request needs at least one prompt token")
        if len(request.prompt) + request.max_tokens > self.context:
            raise ValueError(
                f"serve: {len(request.prompt)} prompt tokens + max_tokens {request.max_tokens} exceed the "
                f"context of {self.context}"
            )
        with self._wake:
            if self._stopping:
                raise ServerBusyError("serve: the server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise ServerBusyError(f"serve: {len(self._waiting)} requests are already waiting")
            self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Frees the request's slot at the worker's next turn (a waiting request never starts)."""
        request.cancelled = True

    def stop(self, timeout: float | None = None) -> None:
        """Finishes the requests already taken, refuses new ones, and ends the worker."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._worker.is_alive():
            self._worker.join(timeout)

    def load(self) -> dict[str, int]:
        """How many requests are decoding and how many wait."""
        return {"running": self._table.live_count(), "waiting": len(self._waiting)}

    def _serve(self) -> None:
        while True:
            with self._wake:
                while not (self._waiting or self._table.live_count() or self._stopping):
                    self._wake.wait()
                if self._stopping and not self._waiting and not self._table.live_count():
                    return
                group = self._take_group()
            try:
                if group:
                    self._prefill(group)
                if self._table.live_count():
                    self._decode()
            except Exception as err:  # noqa: BLE001 - the device failed: fail these requests, keep serving
                log.exception("serve: the device step failed")
                for request in group + self._table.clear():
                    request.on_token(None, f"error: {type(err).__name__}: {err}")

    def _take_group(self) -> list[Request]:
        """The waiting requests that join this turn: FIFO, as many as free slots allow, one prefill width."""
        group: list[Request] = []
        longest = most = 0
        while self._waiting and len(group) < min(self._table.free_count(), self.max_prefill):
            request = self._waiting[0]
            if request.cancelled:
                self._waiting.popleft()
                continue
            n, m = max(longest, len(request.prompt)), max(most, request.max_tokens)
            if group and n + m > self.context:
                break  # joins next turn, with requests its width fits
            group.append(self._waiting.popleft())
            longest, most = n, m
        return group

    def _prefill(self, group: list[Request]) -> None:
        longest = max(len(r.prompt) for r in group)
        most = max(r.max_tokens for r in group)
        width = _bucket(longest)
        width = width if width + most <= self.context else longest
        rows = _bucket(len(group), minimum=1)
        ids = np.zeros((rows, width), np.int32)
        mask = np.zeros((rows, width), bool)
        mask[:, -1] = True  # padding rows: one real position, so that no row is empty
        for i, request in enumerate(group):
            ids[i, width - len(request.prompt) :] = request.prompt
            mask[i, width - len(request.prompt) :] = True
        sampling = _sampling(group, rows)
        first, rows_cache = prefill(self.model, self.policy, self.context, self.params, self.state,
                                           ids, mask, sampling)  # fmt: skip
        first = np.asarray(first)
        for i, request in enumerate(group):
            slot = self._table.take(request, len(request.prompt))
            self._pool = place(self._pool, rows_cache, np.int32(i), np.int32(slot))
            self._table.produced(slot, int(first[i]))

    def _decode(self) -> None:
        t = self._table
        sampling = RowSampling(t.temperature, t.top_k, t.top_p, t.key_data, t.count)
        live = t.live.copy()
        next_tokens, self._pool = decode(self.model, self.policy, self.params, self.state, self._pool,
                                                t.token, t.position, live, sampling)  # fmt: skip
        next_tokens = np.asarray(next_tokens)
        for slot in np.flatnonzero(live):
            t.position[slot] += 1
            t.produced(int(slot), int(next_tokens[slot]))


def _bucket(n: int, minimum: int = MIN_WIDTH) -> int:
    return max(minimum, 1 << (n - 1).bit_length())


def _row_buckets(max_prefill: int) -> list[int]:
    """The row counts a prefill pads its joining requests to: 1, 2, 4, ... up to the bucket of `max_prefill`."""
    top = _bucket(max_prefill, minimum=1)
    return [1 << i for i in range(top.bit_length())]


def every_width(longest: int) -> list[int]:
    """One prompt length for each padded width that prompts of 1 to `longest` tokens take (for `warm_up`)."""
    return sorted({min(_bucket(n), longest) for n in range(1, longest + 1)})


def _sampling(group: list[Request], rows: int) -> RowSampling:
    """The prefill rows' sampling settings (padding rows greedy)."""
    temperature = np.zeros(rows, np.float32)
    top_k = np.zeros(rows, np.int32)
    top_p = np.ones(rows, np.float32)
    key_data = np.zeros((rows, 2), np.uint32)
    for i, r in enumerate(group):
        temperature[i], top_k[i], top_p[i], key_data[i] = r.temperature, r.top_k, r.top_p, r.key_data
    return RowSampling(temperature, top_k, top_p, key_data, np.zeros(rows, np.int32))


class _SlotTable:
    """The host's record of every slot: its request, the token it feeds next, its position and sampling rows."""

    def __init__(self, slots: int) -> None:
        self.requests: list[Request | None] = [None] * slots
        self.live = np.zeros(slots, bool)
        self.token = np.zeros(slots, np.int32)
        self.position = np.zeros(slots, np.int32)
        self.count = np.zeros(slots, np.int32)
        self.temperature = np.zeros(slots, np.float32)
        self.top_k = np.zeros(slots, np.int32)
        self.top_p = np.ones(slots, np.float32)
        self.key_data = np.zeros((slots, 2), np.uint32)

    def live_count(self) -> int:
        return int(self.live.sum())

    def free_count(self) -> int:
        return len(self.live) - self.live_count()

    def take(self, request: Request, length: int) -> int:
        slot = int(np.flatnonzero(~self.live)[0])
        self.requests[slot], self.live[slot], self.position[slot], self.count[slot] = request, True, length, 0
        self.temperature[slot], self.top_k[slot], self.top_p[slot] = request.temperature, request.top_k, request.top_p
        self.key_data[slot] = request.key_data
        return slot

    def produced(self, slot: int, token: int) -> None:
        """Hands the slot's new token to its request, and frees the slot when the request is over."""
        request = self.requests[slot]
        assert request is not None
        if request.cancelled:
            self._free(slot)
            return
        request.produced += 1
        self.token[slot], self.count[slot] = token, request.produced
        finish = "stop" if token in request.stop_ids else "length" if request.produced >= request.max_tokens else None
        if finish is not None:
            self._free(slot)
        request.on_token(token, finish)

    def clear(self) -> list[Request]:
        """Frees every slot; returns the requests that held one."""
        held = [r for r in self.requests if r is not None]
        for slot in range(len(self.requests)):
            self._free(slot)
        return held

    def _free(self, slot: int) -> None:
        self.requests[slot], self.live[slot] = None, False
