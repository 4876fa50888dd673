"""The rollout engine's host scheduler: slots, pages, refills, prefix sharing, admission and preemption.

Why a module of its own: this is plain Python bookkeeping over lists and counters, run identically on every
process of a run (the scheduler is replicated SPMD: same host data in, same decisions out); it never touches a
device array itself. Each round it decides what the three device programs (programs.py, through `Device`) run
and records what they return. The user-facing calls (api.py: generate / start / extend) only validate their
input, build `Conversation`s and queue them here.

The state:
- `Conversation`: one sequence (sample g of prompt p): its tokens, its pages and where it is in its turn.
- `_Shard`: one data shard's page pool (paged_kv.PagePool, shard-local page ids), decode slots, request queue
  and prompt prefix entries (`_Prefix`). A mesh split over D data shards has D, each scheduled alone.
- `_Batch`: the running batch, from the first conversation queued on an idle engine until none is queued or
  decoding; its rows share their SamplingParams and `keep`.

One round (`Scheduler.advance`): admit queued rows into free slots (their first pages reserved), run one prefill
chunk over every row with conversation tokens still to write, attach rows whose shared prompt prefix is complete
(copy-on-write of its partial last page), grow every ready row by the pages its next chunk writes (evicting
parked rows, then preempting the most recently admitted ones on a short pool), decode one chunk, and retire the
rows whose turn ended (their slots free at once; their pages kept with keep=True, for a later `extend`).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import numpy as np

from stare_jax.config.engine import EngineConfig
from stare_jax.models import paged_attention as pa
from stare_jax.sampling import paged_kv
from stare_jax.sampling.engine.programs import Device
from stare_jax.sampling.params import SamplingParams

EXIT_FRACTION = 4  # a decode chunk ends early once 1/EXIT_FRACTION of the slots can be refilled
MIN_ROWS = 4  # smallest prefill / decode batch (fewer compiled shapes)
MIN_WIDTH = 1  # smallest page-table width (pages) of a program (buckets: powers of two)


# ----------------------------------------------------------------------------------------------- host state


@dataclasses.dataclass
class _Prefix:
    """A prompt's shared prefix (the prompt minus its last token) being / having been prefilled once."""

    key: int  # the prompt's position in the call
    tokens: list[int]
    pages: list[int]
    waiting: int  # samples of this prompt not yet attached; the entry is dropped at 0
    written: int = 0

    @property
    def complete(self) -> bool:
        return self.written >= len(self.tokens)


@dataclasses.dataclass
class Conversation:
    """One sequence (sample g of prompt p) of the engine: its tokens, pages and sampling position.

    tokens: the whole conversation (prompt, then sampled and appended tokens). response_mask: 1 for sampled
    tokens, 0 for appended ones (tool output) -- the loss mask. response_logprobs: temperature-1 log-probs of
    sampled tokens, NaN for appended ones. turn_tokens / turn_logprobs: what the last call sampled.
    """

    index: int
    prompt_index: int
    sample: int
    prompt_len: int
    seq: list[int]  # tokens before this turn's sampled ones
    response_mask: list[int] = dataclasses.field(default_factory=list)
    response_logprobs: list[float] = dataclasses.field(default_factory=list)
    turn_tokens: list[int] = dataclasses.field(default_factory=list)
    turn_logprobs: list[float] = dataclasses.field(default_factory=list)
    finished_eos: bool = False
    pages: list[int] = dataclasses.field(default_factory=list)
    written: int = 0  # tokens whose k/v are in pages (all but the last token once ready)
    budget: int = 0  # response index at which this turn stops
    turn_start: int = 0  # response index of this turn's first sampled token
    prefix: _Prefix | None = None
    tail: int | None = None  # private page reserved for the copy of the prefix's partial last page
    admitted: int = 0
    closed: bool = False
    shareable: bool = False  # a fresh first turn that may attach to its prompt's prefix entry
    prompt_pos: int = 0  # the prompt's position in the call (prefix entries are keyed by it)
    shard: int = 0  # the data shard whose slots and page pool hold it (page ids are that pool's)
    running: bool = False  # queued or in a slot of the running batch (its turn has not ended)

    @property
    def tokens(self) -> list[int]:
        return self.seq + self.turn_tokens

    @property
    def response_tokens(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def step(self) -> int:
        """Response index of the next draw (the key's step)."""
        return len(self.tokens) - self.prompt_len

    @property
    def ready(self) -> bool:
        return self.prefix is None and self.written == len(self.tokens) - 1

    def new_turn(self, max_new_tokens: int, appended: Sequence[int] = ()) -> None:
        """Commit the last turn's sampled tokens, append the given ones (mask 0, log-prob NaN), open a new turn of
        up to max_new_tokens sampled tokens."""
        self.response_mask += [1] * len(self.turn_tokens) + [0] * len(appended)
        self.response_logprobs += self.turn_logprobs + [float("nan")] * len(appended)
        self.seq = self.tokens + list(appended)
        self.turn_tokens, self.turn_logprobs, self.finished_eos = [], [], False
        self.turn_start = self.step
        self.budget = self.step + max_new_tokens


@dataclasses.dataclass
class _Shard:
    """One data shard's scheduler state during a call: its page pool (shard-local page ids), decode slots, request
    queue and prompt prefix entries. A one-shard engine has one; a mesh split over D data shards has D, each
    scheduled alone (its rows never touch another shard's pages)."""

    pool: paged_kv.PagePool
    slots: list[Conversation | None]
    queue: collections.deque = dataclasses.field(default_factory=collections.deque)
    prefixes: dict[int, _Prefix] = dataclasses.field(default_factory=dict)
    waiting: collections.Counter = dataclasses.field(default_factory=collections.Counter)  # unattached samples
    ended: list[Conversation] = dataclasses.field(default_factory=list)  # turns ended this round (slots freed)

    def busy(self) -> bool:
        return bool(self.queue) or any(c is not None for c in self.slots)

    def ready(self) -> list[tuple[int, Conversation]]:
        """(slot, row) of every row ready to decode."""
        return [(s, c) for s, c in enumerate(self.slots) if c is not None and c.ready]


@dataclasses.dataclass
class _Batch:
    """The running batch: every data shard's scheduler state and what its rows share (the draw options, keep),
    from the first conversation queued on an idle engine until no conversation is queued or decoding."""

    shards: list[_Shard]
    sampling: SamplingParams
    draw_inputs: list  # `sampling` placed as the decode program's inputs (Device.draw_inputs)
    keep: bool

    def busy(self) -> bool:
        return any(sh.busy() for sh in self.shards)


def assign_shards(work_P: Sequence[int], shards: int) -> list[int]:
    """The data shard of each prompt (all its samples go there, so its prefix pages are shared within one pool):
    greedily the shard with the least queued token work so far, ties to the lowest shard (round-robin for equal
    work)."""
    load = [0] * shards
    out = []
    for w in work_P:
        d = min(range(shards), key=lambda i: (load[i], i))
        load[d] += int(w)
        out.append(d)
    return out


# ----------------------------------------------------------------------------------------------- the scheduler


class Scheduler:
    """The host side of one engine: its page pools (one per data shard), the running batch, the rows parked
    between turns, and `stats` (per batch: prefix prefills, recomputes, evictions, prefill calls / tokens, decode
    chunks / steps, rounds, the peak number of pages in use)."""

    def __init__(self, device: Device, engine_config: EngineConfig):
        self.device = device
        self.engine_config = engine_config
        self.pools: list[paged_kv.PagePool] | None = None  # one per data shard (None until the first call)
        self.stats: dict = {}
        self.batch: _Batch | None = None  # the running batch (conversations queued or decoding)
        self.parked: list[Conversation] = []  # rows between turns that keep their pages (keep=True), in park order
        self._admitted = 0

    # ------------------------------------------------------------------ sizes
    def slots_per_shard(self) -> int:
        """Decode slots of each data shard: max_slots split over the shards (rounded up)."""
        slots = self.engine_config.max_slots
        assert isinstance(slots, int)  # auto is refused by the Engine
        return -(-slots // self.device.data_shards)

    def pages_per_shard(self, longest_tokens: int) -> int:
        """Pages of each data shard's pool for requests of up to `longest_tokens` tokens: num_pages / D, or in auto
        mode (num_pages 0) enough for every slot of the shard (EngineConfig.pool_pages)."""
        ec, D = self.engine_config, self.device.data_shards
        return (
            -(-ec.num_pages // D)
            if ec.num_pages
            else dataclasses.replace(ec, max_slots=self.slots_per_shard()).pool_pages(longest_tokens)
        )

    def row_bucket(self, num_rows: int) -> int:
        """Rows of a prefill or decode call (per shard): a power-of-two bucket of the rows with work (at least
        MIN_ROWS, at most a shard's slots): a round that prefills one new prompt, or decodes the last rows of a
        draining queue, must not pay for max_slots rows."""
        return min(1 << (max(num_rows, MIN_ROWS) - 1).bit_length(), self.slots_per_shard())

    def width(self, num_pages: int) -> int:
        """Page-table width of a call: a power-of-two bucket of the live pages, at least MIN_WIDTH pages (few
        programs), at most the context's pages."""
        max_pos = getattr(self.device.config, "max_position_embeddings", None) or 1 << 20
        return paged_kv.width_bucket(
            max(num_pages, MIN_WIDTH), paged_kv.pages_for(max_pos, self.engine_config.page_size)
        )

    def live_pools(self) -> list[paged_kv.PagePool]:
        if self.pools is None:
            raise RuntimeError("the engine has no page pool yet: it is made by the first generate call")
        return self.pools

    # ------------------------------------------------------------------ pools
    def ensure_pool(self, convs: Sequence[Conversation]) -> None:
        """Allocate the page pools once (or grow them in auto mode): one of num_pages / D pages per data shard;
        ValueError if one request cannot fit a shard's pool."""
        ec, D = self.engine_config, self.device.data_shards
        longest = max(len(c.seq) + (c.budget - c.turn_start) for c in convs)
        one = paged_kv.pages_for(longest, ec.page_size) + 1  # + the prefix entry's staging page
        num = self.pages_per_shard(longest)
        if ec.num_pages == 0 and self.pools is not None:
            if self.pools[0].num_pages >= num or not all(p.all_free() for p in self.pools):
                num = self.pools[0].num_pages  # never shrink; with live conversations keep it (preemption copes)
        if num - 1 < one:
            per_shard = f" ({num} pages for each of {D} data shards)" if D > 1 else ""
            raise ValueError(
                f"sampling.engine.num_pages={ec.num_pages or num}{per_shard} cannot hold one request of "
                f"{longest} tokens with sampling.engine.page_size={ec.page_size}: needs >= "
                f"{D * (one + 1)}"
            )
        if self.pools is None or self.pools[0].num_pages != num:
            if self.pools is not None and not all(p.all_free() for p in self.pools):
                raise RuntimeError(
                    "the page pool must grow but live conversations hold pages: close them first "
                    "or set sampling.engine.num_pages"
                )
            self.device.init_pages(num)
            self.pools = [paged_kv.PagePool(num) for _ in range(D)]

    def release_pools(self) -> None:
        """Drop the pools (host and device) when no conversation holds pages and nothing runs."""
        if self.batch is None and (self.pools is None or all(p.all_free() for p in self.pools)):
            self.device.pages = None
            self.pools = None

    # ------------------------------------------------------------------ queueing, running, closing
    def run(self, convs: list[Conversation], *, keep: bool, sampling: SamplingParams, wait: bool = True) -> None:
        """Queue conversations (their turn opened) in the running batch, or in a new one (its stats start from 0),
        and with wait run rounds (`advance`) until the batch is done. wait=True needs an idle engine; wait=False
        joins a running batch of the same SamplingParams and keep."""
        if self.device.state is None:
            raise RuntimeError("the engine's weights were released: call update_params(params) first")
        b = self.batch
        if b is not None and (wait or (b.sampling, b.keep) != (sampling, keep)):
            raise ValueError(
                "the engine is running conversations queued with wait=False: queue more with "
                "wait=False and the same sampling arguments and keep, and drive them with advance()"
            )
        if not convs:
            return
        self.ensure_pool(convs)
        if b is None:
            self.stats = dict(
                prefix_prefills=0,
                recomputes=0,
                evictions=0,
                prefill_calls=0,
                prefill_tokens=0,
                decode_chunks=0,
                decode_steps=0,
                peak_pages=0,
                rounds=0,
            )
            b = _Batch(
                [_Shard(pool, [None] * self.slots_per_shard()) for pool in self.live_pools()],
                sampling,
                self.device.draw_inputs(sampling),
                keep,
            )
            for sh in b.shards:
                sh.pool.peak_used = sh.pool.num_used
            self.batch = b
        for sh, pool in zip(b.shards, self.live_pools()):
            sh.pool = pool  # ensure_pool may have made new (empty) pools
        self.unpark(convs)
        for c in convs:
            b.shards[c.shard].queue.append(c)
            b.shards[c.shard].waiting[c.prompt_pos] += c.shareable
            c.running = True
        while wait and self.batch is not None:
            self.advance()

    def advance(self) -> list[Conversation]:
        """One round of the running batch (admit, prefill a chunk, attach, decode up to decode_chunk steps,
        retire). Returns the conversations whose turn ended in it, in slot order; [] when nothing runs."""
        b = self.batch
        if b is None:
            return []
        try:
            with self.device.program_context():
                self.stats["rounds"] += 1
                progress = any([self._admit(sh) for sh in b.shards])
                progress |= self._prefill_round(b.shards)
                self._attach(b.shards)
                progress |= self._decode_round(b.shards, b.draw_inputs, b.keep)
            if not progress and not any(self._drop_idle_prefix(sh) for sh in b.shards):
                raise paged_kv.PagesExhausted(
                    f"the page pool ({[sh.pool.num_pages for sh in b.shards]} pages per shard, "
                    f"{[sh.pool.num_free for sh in b.shards]} free) cannot make progress: raise "
                    f"sampling.engine.num_pages"
                )
        except BaseException:
            self.cancel()
            raise
        self.stats["peak_pages"] = sum(sh.pool.peak_used for sh in b.shards)
        ended = [c for sh in b.shards for c in sh.ended]
        for sh in b.shards:
            sh.ended.clear()
        for c in ended:
            c.running = False
        self.parked += [c for c in ended if not c.closed]
        if not b.busy():
            self.batch = None
        return ended

    def close(self, convs: Sequence[Conversation]) -> None:
        """Free the pages of finished conversations; closing a running one cancels the running batch first."""
        if any(c.running for c in convs):
            self.cancel()
        self.unpark(convs)
        for c in convs:
            if not c.closed:
                self.live_pools()[c.shard].release(c.pages)
                c.pages, c.closed = [], True

    def cancel(self) -> None:
        """Drop the running batch (after an error, or the close of one of its rows): its prefix entries' pages and
        reserved tail pages go back to the pools; its rows stop running, keeping their own pages."""
        b, self.batch = self.batch, None
        for sh in b.shards if b is not None else []:
            for e in sh.prefixes.values():
                sh.pool.release(e.pages)
            for c in [*sh.queue, *sh.slots]:
                if c is not None:
                    if c.tail is not None:
                        sh.pool.release([c.tail])
                    c.prefix, c.tail, c.running, c.shareable = None, None, False, False

    def unpark(self, convs: Sequence[Conversation]) -> None:
        ids = {id(c) for c in convs}
        self.parked = [c for c in self.parked if id(c) not in ids]

    # ------------------------------------------------------------------ pages: room, growth, preemption
    def _make_room(self, sh: _Shard, num: int) -> bool:
        """True when `num` pages of a shard's pool are free, after freeing if needed the pages of rows parked
        between turns, the most recently parked first (a row waiting on a tool call must not exhaust the pool for
        the rows that decode); an evicted row's next turn prefills its whole conversation again."""
        while num > sh.pool.num_free:
            parked = [c for c in self.parked if c.pages and self.live_pools()[c.shard] is sh.pool]
            if not parked:
                return False
            c = parked[-1]
            sh.pool.release(c.pages)
            c.pages, c.written = [], 0
            self.stats["evictions"] += 1
        return True

    def _growth(self, slots) -> list[tuple[Conversation, int]]:
        """(row, pages it still needs for its next decode chunk) for every ready row, oldest admission first."""
        ec = self.engine_config
        ready = sorted((c for c in slots if c is not None and c.ready), key=lambda c: c.admitted)
        return [
            (c, paged_kv.pages_for(c.written + min(ec.decode_chunk, c.budget - c.step), ec.page_size) - len(c.pages))
            for c in ready
        ]

    def _grow(self, sh: _Shard) -> None:
        """Give every ready row of a shard the pages its next chunk writes into. On a short pool free the pages of
        parked rows (`_make_room`), then preempt the most recently admitted rows (back to the queue front,
        recomputed later) until the rest fit; with one row left, drop the prefix entries no row in a slot is
        waiting for."""
        while True:
            growth = self._growth(sh.slots)
            if not growth:
                return
            if self._make_room(sh, sum(max(n, 0) for _, n in growth)):
                for c, n in growth:
                    if n > 0:
                        c.pages += sh.pool.alloc(n)
                return
            rows = sorted((c for c in sh.slots if c is not None), key=lambda c: c.admitted)
            if len(rows) > 1:  # the oldest row always keeps going: no livelock
                self._preempt(rows[-1], sh)
                continue
            if not self._drop_idle_prefix(sh):
                raise paged_kv.PagesExhausted(
                    f"one row needs {growth[0][1]} more pages, {sh.pool.num_free} free: raise sampling.engine.num_pages"
                )

    def _drop_idle_prefix(self, sh: _Shard) -> bool:
        """Free the pages of one of a shard's prefix entries that no row in a slot waits for (it is prefilled
        again when its next sample is admitted); False if there is none."""
        idle = [e for e in sh.prefixes.values() if not any(c is not None and c.prefix is e for c in sh.slots)]
        if not idle:
            return False
        sh.pool.release(idle[0].pages)
        del sh.prefixes[idle[0].key]
        return True

    def _preempt(self, c: Conversation, sh: _Shard) -> None:
        """Free a row's pages and requeue it at its shard's queue front. A row still waiting for its prompt's
        prefix just gives back its reserved tail page; any other row is recomputed later (same draws, same
        tokens)."""
        if c.prefix is not None:
            if c.tail is not None:
                sh.pool.release([c.tail])
            c.prefix, c.tail = None, None
        else:
            sh.pool.release(c.pages)
            c.pages, c.written, c.shareable = [], 0, False
            c.turn_tokens, c.turn_logprobs = [], []
            self.stats["recomputes"] += 1
        sh.slots[sh.slots.index(c)] = None
        sh.queue.appendleft(c)

    # ------------------------------------------------------------------ the round's steps
    def _admit(self, sh: _Shard) -> bool:
        """Move a shard's queued conversations into its free slots while their first pages can be allocated."""
        progress = False
        reserve = sum(max(n, 0) for _, n in self._growth(sh.slots))  # running rows grow first (no livelock)
        for s in range(len(sh.slots)):
            if sh.slots[s] is not None:
                continue
            if not sh.queue or not self._reserve_first_pages(sh, sh.queue[0], reserve):
                break
            c = sh.queue.popleft()
            self._admitted += 1
            c.admitted = self._admitted
            sh.slots[s] = c
            progress = True
        return progress

    def _reserve_first_pages(self, sh: _Shard, c: Conversation, reserve: int) -> bool:
        """Allocate what a queued row prefills before its first decode, keeping `reserve` pages free for the
        running rows; False (nothing allocated) when they do not fit. A fresh first turn that shares its
        prompt's prefix gets (or creates) the prompt's prefix entry and a private tail page; any other row
        (recompute, continuation, one-token prompt) its own pages for what it must prefill."""
        ec = self.engine_config
        if ec.share_prefix and c.shareable:
            entry = sh.prefixes.get(c.prompt_pos)
            n_tail = 1 if (c.prompt_len - 1) % ec.page_size else 0
            need = n_tail + (0 if entry else paged_kv.pages_for(c.prompt_len - 1, ec.page_size))
            if not self._make_room(sh, need + reserve):
                return False
            if entry is None:
                entry = _Prefix(c.prompt_pos, c.seq[:-1], sh.pool.alloc(need - n_tail), sh.waiting[c.prompt_pos])
                sh.prefixes[c.prompt_pos] = entry
                self.stats["prefix_prefills"] += 1
            c.prefix, c.tail = entry, (sh.pool.alloc(1)[0] if n_tail else None)
            return True
        need = paged_kv.pages_for(len(c.tokens) - 1, ec.page_size) - len(c.pages)
        if not self._make_room(sh, need + reserve):
            return False
        c.pages += sh.pool.alloc(max(need, 0))
        return True

    def _prefill_jobs(self, sh: _Shard) -> list:
        """(owner, tokens, start, pages) of a shard's unfinished prefix entries and of its slot rows that still
        have conversation tokens to write; at most one program's rows (the rest next round)."""
        jobs: list = [(e, e.tokens, e.written, e.pages) for e in sh.prefixes.values() if not e.complete]
        jobs += [
            (c, c.tokens[:-1], c.written, c.pages)
            for c in sh.slots
            if c is not None and c.prefix is None and c.written < len(c.tokens) - 1
        ]
        return jobs[: len(sh.slots)]

    def _prefill_round(self, shards: list[_Shard]) -> bool:
        """One chunk of up to prefill_chunk tokens for every unfinished prefix entry and every slot row that still
        has conversation tokens to write, in one jitted call over every shard."""
        ec = self.engine_config
        jobs_D = [self._prefill_jobs(sh) for sh in shards]
        every = [j for jobs in jobs_D for j in jobs]
        if not every:
            return False
        C = ec.prefill_width(max(len(toks) - start for _, toks, start, _ in every))
        R = self.row_bucket(max(len(jobs) for jobs in jobs_D))
        width = self.width(max(len(j[3]) for j in every))
        D = len(shards)
        ids, pos, valid = (np.zeros((D, R, C), np.int32) for _ in range(3))
        table = np.zeros((D, R, width), np.int32)
        for d, jobs in enumerate(jobs_D):
            for r, (owner, toks, start, _) in enumerate(jobs):
                chunk = toks[start : start + C]
                ids[d, r, : len(chunk)] = chunk
                pos[d, r, : len(chunk)] = np.arange(start, start + len(chunk))
                valid[d, r, : len(chunk)] = 1
                owner.written = start + len(chunk)
                self.stats["prefill_tokens"] += len(chunk)
            table[d] = paged_kv.page_table([j[3] for j in jobs] + [[]] * (R - len(jobs)), width)
        self.device.prefill(ids, pos, valid.astype(bool), table)
        self.stats["prefill_calls"] += 1
        return True

    def _attach(self, shards: list[_Shard]) -> None:
        """Rows whose prefix entry is complete: share its full pages, copy its partial last page into the row's
        private tail page (one copy program over every shard); drop entries whose samples are all attached."""
        ps = self.engine_config.page_size
        copies_D = []
        for sh in shards:
            src, dst = [], []
            for c in sh.slots:
                if c is None or c.prefix is None or not c.prefix.complete:
                    continue
                entry = c.prefix
                n_full = len(entry.tokens) // ps
                sh.pool.share(entry.pages[:n_full])
                c.pages = entry.pages[:n_full] + ([c.tail] if c.tail is not None else [])
                if c.tail is not None:
                    src.append(entry.pages[n_full])
                    dst.append(c.tail)
                c.written, c.prefix, c.tail, c.shareable = len(entry.tokens), None, None, False
                entry.waiting -= 1
                sh.waiting[entry.key] -= 1
                if entry.waiting == 0:
                    sh.pool.release(entry.pages)
                    del sh.prefixes[entry.key]
            copies_D.append((src, dst))
        longest = max(len(src) for src, _ in copies_D)
        if longest:
            rows = len(shards[0].slots)
            n = -(-longest // rows) * rows  # one program shape
            pad = lambda x: x + [pa.TRASH_PAGE] * (n - len(x))  # noqa: E731
            self.device.copy(
                np.asarray([pad(src) for src, _ in copies_D], np.int32),
                np.asarray([pad(dst) for _, dst in copies_D], np.int32),
            )

    @staticmethod
    def _exit_after(queue, num_rows: int) -> int:
        """Finished rows that end a decode chunk early: enough to refill a quarter of the slots (or all the
        queue), so freed slots do not idle until the chunk's end; never with an empty queue."""
        if not queue:
            return num_rows + 1
        return max(1, min(len(queue), -(-num_rows // EXIT_FRACTION)))

    def _decode_round(self, shards: list[_Shard], draw_inputs: list, keep: bool) -> bool:
        """Up to decode_chunk steps of every ready slot of every shard (one program); record the tokens and
        retire the rows whose turn ended (to their shard's `ended`)."""
        if not any(sh.ready() for sh in shards):
            return False
        for sh in shards:
            if sh.ready():
                self._grow(sh)
        ready_D = [sh.ready() for sh in shards]
        if not any(ready_D):
            return True  # everything ready was preempted: the pages went back, the queue goes on
        # the ready rows, compacted: a draining tail does not pay for max_slots
        S = self.row_bucket(max(len(ready) for ready in ready_D))
        live_D = [[c for _, c in ready] + [None] * (S - len(ready)) for ready in ready_D]
        width = self.width(max(len(c.pages) for live in live_D for c in live if c is not None))
        table = np.stack([paged_kv.page_table([c.pages if c else [] for c in live], width) for live in live_D])
        exit_after = np.asarray([self._exit_after(sh.queue, S) for sh in shards], np.int32)
        toks, lps, n, eos = self.device.decode(table, self._decode_rows(live_D), exit_after, draw_inputs)
        self.stats["decode_chunks"] += 1
        self.stats["decode_steps"] += int(n.max(initial=0))
        for sh, ready, toks_S, lps_S, n_S, eos_S in zip(shards, ready_D, toks, lps, n, eos):
            for r, (s, c) in enumerate(ready):
                k = int(n_S[r])
                c.turn_tokens += toks_S[r, :k].tolist()
                c.turn_logprobs += lps_S[r, :k].tolist()
                c.written += k
                if eos_S[r] or c.step >= c.budget:
                    self._retire(sh, s, c, finished_eos=bool(eos_S[r]), keep=keep)
        return True

    @staticmethod
    def _decode_rows(live_D: list[list[Conversation | None]]) -> dict[str, np.ndarray]:
        """The per-row inputs [D, S] of a decode chunk (0 in the padding rows): the last token, its position,
        the response index of the next draw, the turn's budget, liveness and the draw keys' prompt / sample."""

        def arr(f, dt=np.int32):
            return np.asarray([[f(c) if c else 0 for c in live] for live in live_D], dt)

        return dict(
            tok=arr(lambda c: c.tokens[-1]),
            pos=arr(lambda c: c.written),
            step=arr(lambda c: c.step),
            budget=arr(lambda c: c.budget),
            live=arr(lambda c: True, bool),
            prompt_index=arr(lambda c: c.prompt_index, np.uint32),
            sample=arr(lambda c: c.sample, np.uint32),
        )

    @staticmethod
    def _retire(sh: _Shard, s: int, c: Conversation, *, finished_eos: bool, keep: bool) -> None:
        """A row whose turn ended: its slot is free at once; without keep its pages go back too."""
        c.finished_eos = finished_eos
        sh.slots[s] = None
        sh.ended.append(c)
        if not keep:
            sh.pool.release(c.pages)
            c.pages, c.closed = [], True
