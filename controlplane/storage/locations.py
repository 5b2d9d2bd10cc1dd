"""Program locations in PostgreSQL, shared by the replicas of one database, and the moves
they reveal, published to every replica with ``NOTIFY``.

Behind several ``cachettl serve`` replicas on one PostgreSQL schema, an engine linked to
replica A and one linked to replica B share no server memory, so pin coherence
(:mod:`controlplane.coherence`) keeps the locations here: table ``program_locations``, one
row per (tenant, program id).

A report is one statement (:data:`_REPORT`), one round trip, its own transaction: it locks
the reported programs' rows, upserts their new engine (unless the row holds a later
arrival: a report that came late leaves it, and its engine is told where the program went
on), and publishes the moves it found
(``pg_notify`` on the schema's channel, :func:`channel_of`), in payloads of at most
:data:`PAYLOAD_BYTES` (PostgreSQL refuses 8,000 or more), which it also returns. Two
replicas reporting the same program serialise on its row, so each move is found once, by
the report that made it. The notifications go out when the statement commits, in commit
order.

Every replica with watchers listens on the channel (:meth:`SharedLocations.listen`, an
asyncio connection of its own) and hands the moves to its watchers; a payload names the
replica that published it, so a replica skips its own (it told its watchers at once).

Bounds, kept off the request path by :meth:`SharedLocations.maintain`, which each replica
runs in the background: rows not refreshed for :data:`KEEP_S` are deleted every
:data:`PRUNE_EVERY_S`, and a tenant's rows beyond ``max_programs`` (the least recently seen
first) as soon as the replica has stored :data:`TRIM_CHECK` of its arrivals since it last
looked; both in batches of :data:`PRUNE_BATCH` rows, each its own short transaction that
skips the rows a report holds. A program forgotten so counts as new at its next arrival
(nothing is sent). With the default TTL cap (300 s) no pin outlives its program's row.

Failure: when the listening connection drops, it reconnects with backoff
(:data:`RETRY_FIRST_S` doubling to :data:`RETRY_MAX_S`) and logs once when it is lost and
once when it listens again, with the failed attempts and the outage's length
(:mod:`controlplane.storage.outages`, loop ``listen``; the upkeep is loop ``locations``). Moves
published meanwhile are not heard on that replica: the pins they would have dropped live
until their TTL, as they would without pin coherence. A failed report stores nothing and
publishes nothing (the engine counts its arrivals as dropped).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy import Engine

from controlplane.errors import StorageError
from controlplane.records import MAX_PROGRAM_LOCATIONS, Move, Tenant
from controlplane.storage.base import Store
from controlplane.storage.outages import Outages
from controlplane.storage.sql import SqlStore, autocommit

__all__ = [
    "KEEP_S",
    "PAYLOAD_BYTES",
    "PRUNE_BATCH",
    "PRUNE_EVERY_S",
    "TRIM_CHECK",
    "Published",
    "SharedLocations",
    "channel_of",
    "decode",
    "shared_locations",
]

log = logging.getLogger(__name__)

#: Seconds a program's location is kept after its latest reported arrival.
KEEP_S = 3600.0
#: Seconds between two prunings by one replica.
PRUNE_EVERY_S = 10.0
#: Rows deleted per statement when pruning or trimming (one short transaction each).
PRUNE_BATCH = 1000
#: Arrivals of a tenant stored by one replica after which it counts the tenant's rows.
TRIM_CHECK = 10_000
#: Moves are cut into payloads of this many bytes of moves (plus one move and the header,
#: together under 3,000 bytes: a move is at most 2 engine ids and a 256-character program
#: id, JSON-escaped), so a payload stays under PostgreSQL's 8,000.
PAYLOAD_BYTES = 4000
#: First and longest wait before reconnecting the listening connection, seconds.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 5.0
#: Reports tried again after PostgreSQL broke a deadlock (racing first arrivals).
DEADLOCK_TRIES = 3

#: The report (module docstring). ``before`` locks the rows of the reported programs that
#: exist, in program order; ``stored`` upserts them, only once every lock is held (it reads
#: a count of ``before``), in the same order, so that racing reports wait for each other
#: rather than deadlock; ``moves`` are the programs whose row named another engine, cut
#: into payloads by their running size; each payload row is published and returned.
_REPORT = """
WITH arrived AS (
    SELECT a.program_id, a.arrived_at
    FROM unnest(CAST(%(programs)s AS VARCHAR[]), CAST(%(times)s AS FLOAT8[]))
        AS a(program_id, arrived_at)
),
before AS MATERIALIZED (
    SELECT l.program_id, l.engine_id, l.arrived_at
    FROM program_locations l JOIN arrived a ON a.program_id = l.program_id
    WHERE l.tenant_id = %(tenant)s
    ORDER BY l.program_id
    FOR UPDATE OF l
),
stored AS (
    INSERT INTO program_locations (tenant_id, program_id, engine_id, arrived_at, seen_at)
    SELECT %(tenant)s, a.program_id, %(engine)s, a.arrived_at, CAST(%(now)s AS FLOAT8)
    FROM arrived a CROSS JOIN (SELECT count(*) FROM before) AS locked
    ORDER BY a.program_id
    ON CONFLICT (tenant_id, program_id) DO UPDATE SET
        engine_id = EXCLUDED.engine_id,
        arrived_at = EXCLUDED.arrived_at,
        seen_at = EXCLUDED.seen_at
    WHERE program_locations.arrived_at <= EXCLUDED.arrived_at
),
moves AS (
    SELECT a.program_id, CASE
        WHEN a.arrived_at >= b.arrived_at
        THEN json_build_array(b.engine_id, a.program_id, a.arrived_at)
        ELSE json_build_array(CAST(%(engine)s AS TEXT), a.program_id, b.arrived_at, b.engine_id)
    END AS item
    FROM arrived a JOIN before b ON b.program_id = a.program_id
    WHERE b.engine_id <> %(engine)s
),
cut AS (
    SELECT program_id, item,
        sum(octet_length(item::text) + 1) OVER (ORDER BY program_id)
            / CAST(%(chunk)s AS INTEGER) AS part
    FROM moves
),
payloads AS (
    SELECT json_build_object(
        'r', CAST(%(replica)s AS TEXT), 't', CAST(%(tenant_name)s AS TEXT),
        'to', CAST(%(engine)s AS TEXT),
        'm', json_agg(item ORDER BY program_id))::text AS payload
    FROM cut GROUP BY part
)
SELECT payload, pg_notify(CAST(%(channel)s AS TEXT), payload) FROM payloads
"""
#: A batch of rows not refreshed since the cutoff; rows a report holds are left for the
#: next time.
_PRUNE = """
DELETE FROM program_locations WHERE (tenant_id, program_id) IN (
    SELECT tenant_id, program_id FROM program_locations
    WHERE seen_at < %(cutoff)s LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
"""
#: A batch of a tenant's least recently seen rows.
_TRIM = """
DELETE FROM program_locations WHERE (tenant_id, program_id) IN (
    SELECT tenant_id, program_id FROM program_locations
    WHERE tenant_id = %(tenant)s ORDER BY seen_at LIMIT %(batch)s FOR UPDATE SKIP LOCKED)
"""
_COUNT = "SELECT count(*) FROM program_locations WHERE tenant_id = %(tenant)s"


def channel_of(schema: str) -> str:
    """The ``NOTIFY`` channel of a schema's replicas (channels are per database, and
    replicas on different schemas of one database must not hear each other).

    >>> channel_of("public")
    'cachettl_moves_efa1f375d76194fa'
    """
    return "cachettl_moves_" + hashlib.sha256(schema.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Published:
    """One payload: the moves one engine's report revealed, of one tenant, by one replica
    (to that engine, or, for a late report, from it to where the program went on)."""

    replica: str
    tenant: str
    moves: tuple[Move, ...]


def decode(payload: str) -> Published:
    """A payload as :data:`_REPORT` writes it; ``ValueError`` naming what is wrong.

    >>> decode('{"r": "a1", "t": "acme", "to": "e2", "m": [["e1", "p1", 5.0]]}').moves
    (Move(program_id='p1', from_engine='e1', to_engine='e2', arrived_at=5.0),)
    >>> decode('{"r": "a1", "t": "acme", "to": "e1", "m": [["e1", "p1", 9.0, "e3"]]}').moves
    (Move(program_id='p1', from_engine='e1', to_engine='e3', arrived_at=9.0),)
    """
    try:
        body = json.loads(payload)
        replica, tenant, to, moves = body["r"], body["t"], body["to"], body["m"]
        if not all(isinstance(x, str) for x in (replica, tenant, to)):
            raise ValueError("r, t and to must be strings")
        decoded = tuple(_move(item, to) for item in moves)
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"moves payload: {error!r} in {payload[:200]!r}") from None
    return Published(replica, tenant, decoded)


def _move(item: list[Any], to: str) -> Move:
    """``[from, program, at]``, a move to the reporting engine ``to``, or ``[from,
    program, at, elsewhere]``: a late report's program had gone on to ``elsewhere``."""
    if len(item) not in (3, 4):
        raise ValueError(f"a move has 3 or 4 items, got {item!r}")
    return Move(str(item[1]), str(item[0]), str(item[3]) if len(item) == 4 else to, float(item[2]))


def _deadlocked(error: StorageError) -> bool:
    return isinstance(getattr(error.__cause__, "orig", None), psycopg.errors.DeadlockDetected)


class SharedLocations:
    """The program locations of one PostgreSQL schema (module docstring).

    ``report`` and ``prune`` block (call them from a worker thread; any thread, any
    number at once); ``listen`` is asynchronous.
    """

    def __init__(
        self,
        engine: Engine,
        keep_s: float = KEEP_S,
        prune_every_s: float = PRUNE_EVERY_S,
        max_programs: int = MAX_PROGRAM_LOCATIONS,
        trim_check: int = TRIM_CHECK,
        batch: int = PRUNE_BATCH,
        outages: Outages | None = None,
    ) -> None:
        if engine.dialect.name != "postgresql":
            raise ValueError(f"shared locations need PostgreSQL, got {engine.dialect.name}")
        if not keep_s > 0 or not prune_every_s >= 0:
            raise ValueError(f"keep_s must be > 0, prune_every_s >= 0: {keep_s}, {prune_every_s}")
        if min(max_programs, trim_check, batch) < 1:
            raise ValueError(
                f"max_programs, trim_check and batch must be >= 1: "
                f"{max_programs}, {trim_check}, {batch}"
            )
        self.engine = engine
        self.keep_s = keep_s
        self.prune_every_s = prune_every_s
        self.max_programs = max_programs
        self.trim_check = trim_check
        self.batch = batch
        #: Where the listener and the upkeep report their rounds (the store's, when made
        #: by :func:`shared_locations`).
        self.outages = outages or Outages()
        self._channel: str | None = None
        self._pruned_at = float("-inf")
        self._stored: dict[int, int] = {}  # per tenant id, since its rows were last counted
        #: Rows deleted by age, and beyond a tenant's bound.
        self.pruned = 0
        self.trimmed = 0

    def channel(self) -> str:
        """This schema's channel (one query, the first time)."""
        if self._channel is None:
            with autocommit(self.engine) as c:
                schema = c.exec_driver_sql("SELECT current_schema()").scalar()
            self._channel = channel_of(str(schema))
        return self._channel

    def report(
        self,
        tenant: Tenant,
        engine_id: str,
        arrivals: Sequence[tuple[str, float]],
        replica: str,
        now: float | None = None,
    ) -> list[Move]:
        """Store checked ``(program_id, arrived_at)`` arrivals at ``engine_id``; publish and
        return the moves they reveal (one per program: a program reported twice in one
        batch moved at most once, to this engine, and its latest arrival is kept).
        ``now``: the replica's clock (default ``time.time()``), stored for pruning.
        ``StorageError`` when the database fails; then nothing is stored or published."""
        now = time.time() if now is None else now
        latest = dict(arrivals)
        params: dict[str, Any] = {
            "tenant": tenant.id,
            "tenant_name": tenant.name,
            "engine": engine_id,
            "replica": replica,
            "now": now,
            "chunk": PAYLOAD_BYTES,
            "channel": self.channel(),
            "programs": list(latest),
            "times": list(latest.values()),
        }
        for attempt in range(1, DEADLOCK_TRIES + 1):
            try:
                with autocommit(self.engine) as c:
                    payloads = [row[0] for row in c.exec_driver_sql(_REPORT, params)]
                break
            except StorageError as error:
                if attempt == DEADLOCK_TRIES or not _deadlocked(error):
                    raise
        self._stored[tenant.id] = self._stored.get(tenant.id, 0) + len(latest)
        return [move for payload in payloads for move in decode(payload).moves]

    def _batches(self, statement: str, params: dict[str, Any], most: int | None = None) -> int:
        """Run a batched DELETE until it deletes less than a batch (or ``most`` rows)."""
        done = 0
        while most is None or done < most:
            batch = self.batch if most is None else min(self.batch, most - done)
            with autocommit(self.engine) as c:
                n = int(c.exec_driver_sql(statement, {**params, "batch": batch}).rowcount)
            done += n
            if n < batch:
                break
        return done

    def prune(self, now: float) -> int:
        """Delete the rows not refreshed for ``keep_s`` before ``now``, a batch at a time;
        how many."""
        n = self._batches(_PRUNE, {"cutoff": now - self.keep_s})
        self.pruned += n
        return n

    def trim(self, tenant_id: int) -> int:
        """Delete the tenant's least recently seen rows beyond ``max_programs``, a batch
        at a time; how many."""
        self._stored.pop(tenant_id, None)
        with autocommit(self.engine) as c:
            rows = int(c.exec_driver_sql(_COUNT, {"tenant": tenant_id}).scalar_one())
        if rows <= self.max_programs:
            return 0
        n = self._batches(_TRIM, {"tenant": tenant_id}, rows - self.max_programs)
        self.trimmed += n
        return n

    def maintain(self, now: float | None = None) -> int:
        """What the replica's background task runs: prune when :attr:`prune_every_s` has
        passed, and trim every tenant that stored :attr:`trim_check` arrivals here since its
        rows were last counted. Rows deleted. ``StorageError`` when the database fails."""
        now = time.time() if now is None else now
        deleted = 0
        if now - self._pruned_at >= self.prune_every_s:
            self._pruned_at = now
            deleted += self.prune(now)
        for tenant_id in [t for t, n in self._stored.items() if n >= self.trim_check]:
            deleted += self.trim(tenant_id)
        return deleted

    async def listen(self) -> AsyncIterator[Published]:
        """Every payload published on this schema's channel (this replica's too), as it
        comes, until the caller stops; reconnects after a lost connection (module
        docstring: what is missed meanwhile). Payloads that do not decode are logged and
        skipped."""
        url = self.engine.url.set(drivername="postgresql")
        conninfo = url.render_as_string(hide_password=False)
        health = self.outages.loop(
            "listen",
            "moves between replicas (listening connection)",
            log,
            "reconnecting with backoff; until then moves reported through other replicas"
            " are not told here (their pins live until their TTL)",
        )
        wait = RETRY_FIRST_S
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(
                    conninfo, autocommit=True, application_name="cachettl-moves"
                ) as conn:
                    cursor = await conn.execute("SELECT current_schema()")
                    row = await cursor.fetchone()
                    channel = channel_of(str(row[0] if row else ""))
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                    health.succeeded()
                    wait = RETRY_FIRST_S
                    async for note in conn.notifies():
                        try:
                            published = decode(note.payload)
                        except ValueError as error:
                            log.warning("%s", error)
                            continue
                        yield published
            except (psycopg.Error, OSError) as error:
                health.failed(error)
            await asyncio.sleep(wait)
            wait = min(wait * 2, RETRY_MAX_S)


def shared_locations(store: Store) -> SharedLocations | None:
    """The shared locations of a PostgreSQL store; ``None`` for others (their server keeps
    the locations in memory: :class:`controlplane.coherence.ProgramLocations`)."""
    if isinstance(store, SqlStore) and store.engine.dialect.name == "postgresql":
        return SharedLocations(store.engine, outages=store.outages)
    return None
