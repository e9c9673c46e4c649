"""Leader election of master candidates on etcd, and the fence that keeps one leader.

Every master started with `--etcd` is a candidate. A candidate takes a lease (TTL about 5 s)
and creates the leader key `/kvpool/<cluster-id>/leader` attached to it, if the key does not
exist (one etcd transaction); the one that creates it is the leader and keeps the lease
alive, the others watch the key and try again when it goes (lease lapsed or revoked). This
module is that loop (`Elector`, asyncio) and the leader's fence (`Leadership`, pure): it is
not the master's I/O (server.py decides what a request gets from `Leadership.is_leader`) nor
the wait for re-mounting nodes after a takeover (takeover.py).

Never two leaders taking puts. etcd deletes the key only when the lease lapses, no earlier
than `ttl` after etcd last renewed it, and etcd renewed it after we *sent* that keepalive.
So a leader that stops answering at `sent + ttl - margin` on its own clock has stopped
before any successor can exist, whatever happened in between (etcd unreachable, this process
paused by SIGSTOP, a stalled event loop: the check reads the clock, so a request that arrives
after a pause is refused):

    keepalive sent at t ─┬─► etcd renews at t+d (d >= 0) ─► key can lapse from t+d+ttl
                         └─► leader answers until t+ttl-margin, then refuses (NotLeader)
                               standby may win at >= t+d+ttl: at least `margin` later

A standby needs no fence: it answers nothing but NotLeader until it has won. The clock is
CLOCK_BOOTTIME where the platform has it (it keeps counting while the host is suspended, as
etcd's own clock on another host does), else the monotonic clock.

The leader also writes, fenced on its lease, the segments mounted on it under
`/kvpool/<cluster-id>/segments`, so that its successor knows which nodes to wait for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import random
import time
from collections.abc import Sequence
from typing import Protocol

from kvpool import limits
from kvpool.discovery import (
    LeaderRecord,
    check_cluster_id,
    decode_segments_record,
    encode_segments_record,
    leader_key,
    mark_key,
    segments_key,
)
from kvpool.errors import ConnectFailed, CoordinationError, InvalidParams, KVPoolError, RpcTimeout
from kvpool.transports.etcd import EtcdClient

log = logging.getLogger(__name__)

_ETCD_ERRORS = (ConnectFailed, RpcTimeout, CoordinationError)
_RETRY_BACKOFF_MS_MIN = 100
# How often a leader compares its live segments with the record its successor will read.
SEGMENT_RECORD_CHECK_MS = 200
_CLOCK_ID = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


def lease_clock_ms() -> int:
    """The clock of leadership deadlines, in ms (see the module docstring)."""
    return time.clock_gettime_ns(_CLOCK_ID) // 1_000_000


class Role(enum.Enum):
    STANDBY = "standby"
    LEADER = "leader"


_TRANSITIONS: dict[Role, tuple[Role, ...]] = {
    Role.STANDBY: (Role.LEADER,),
    Role.LEADER: (Role.STANDBY,),
}


class Leadership:
    """Whether this candidate may act as leader at a given time.

    Holds the role, the lease and term of the current leadership (the leader key's create
    revision: it grows with every election) and `valid_until_ms`, the lease clock time at
    which a leader must stop answering. Invariant: a STANDBY has `valid_until_ms == 0`, so
    `is_leader` is False for it whatever the clock says.
    """

    __slots__ = ("role", "lease_id", "term", "valid_until_ms", "_margin_ms")

    def __init__(self, step_down_margin_ms: int) -> None:
        assert step_down_margin_ms >= 0, step_down_margin_ms
        self._margin_ms = step_down_margin_ms
        self.role = Role.STANDBY
        self.lease_id = 0
        self.term = 0
        self.valid_until_ms = 0

    def __repr__(self) -> str:
        return f"<Leadership {self.role.value} term={self.term} until={self.valid_until_ms}>"

    def elect(self, lease_id: int, term: int, ttl_ms: int, sent_ms: int) -> None:
        """We created the leader key with a lease granted by a request sent at `sent_ms`."""
        assert lease_id != 0, "a leader needs a lease"
        assert ttl_ms > self._margin_ms, (ttl_ms, self._margin_ms)
        self._transition(Role.LEADER)
        self.lease_id = lease_id
        self.term = term
        self.valid_until_ms = sent_ms + ttl_ms - self._margin_ms

    def renew(self, ttl_ms: int, sent_ms: int) -> None:
        """A keepalive sent at `sent_ms` succeeded with `ttl_ms` left on the lease."""
        assert self.role is Role.LEADER, "renewing a lease we do not lead with"
        self.valid_until_ms = max(self.valid_until_ms, sent_ms + ttl_ms - self._margin_ms)

    def step_down(self) -> None:
        if self.role is Role.LEADER:
            self._transition(Role.STANDBY)
        self.valid_until_ms = 0

    def is_leader(self, now_ms: int) -> bool:
        return self.role is Role.LEADER and now_ms < self.valid_until_ms

    def remaining_ms(self, now_ms: int) -> int:
        """How long this leadership lasts without another successful keepalive (0: over)."""
        return max(0, self.valid_until_ms - now_ms) if self.role is Role.LEADER else 0

    def _transition(self, role: Role) -> None:
        assert role in _TRANSITIONS[self.role], f"leadership {self.role} -> {role}"
        self.role = role


class ElectionListener(Protocol):
    """What the master server does when leadership changes (called on the event loop)."""

    def elected(self, term: int) -> None:
        """This candidate leads from now on (called as it wins, before any await): it takes
        no put nor remove until it has its predecessor's record (`predecessor_record`)."""
        ...

    def predecessor_record(self, expected_segment_ids: list[str] | None) -> None:
        """The predecessor's record of live segments, read after `elected` (None: unreadable
        or no time left to read it)."""
        ...

    def deposed(self, reason: str) -> None:
        """This candidate no longer leads (it already refuses requests: the fence is the
        clock). Drop the state and the connections of the term."""
        ...

    def live_segment_ids(self) -> list[str] | None:
        """The segments to record for a successor, or None while there is nothing to record
        yet (still waiting for the predecessor's nodes)."""
        ...


def lease_ttl_ms_min(step_down_margin_ms: int = limits.LEADER_STEP_DOWN_MARGIN_MS_DEFAULT) -> int:
    """The shortest lease etcd can grant (whole seconds) that is over twice the step-down
    margin: 3 s with the default margin."""
    return 2 * step_down_margin_ms // 1000 * 1000 + 1000


def is_lease_ttl_ms(ttl_ms: int, step_down_margin_ms: int = limits.LEADER_STEP_DOWN_MARGIN_MS_DEFAULT) -> bool:
    """Whether a leader can hold a lease of `ttl_ms`: whole seconds (etcd's unit), and
    lease_ttl_ms_min or more."""
    return ttl_ms >= lease_ttl_ms_min(step_down_margin_ms) and ttl_ms % 1000 == 0


@dataclasses.dataclass(frozen=True)
class ElectionConfig:
    """Where the election happens and how long a leadership lasts without etcd."""

    etcd_endpoints: tuple[str, ...]
    cluster_id: str
    lease_ttl_ms: int = limits.ETCD_LEASE_TTL_MS_DEFAULT
    step_down_margin_ms: int = limits.LEADER_STEP_DOWN_MARGIN_MS_DEFAULT
    cluster_mark: str = ""  # this candidate's (auth.cluster_mark of its token)
    # Marks of its other tokens (rotating in or out: auth.Keyring): the cluster's mark may be
    # one of them, and is then replaced by this candidate's.
    also_marks: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.etcd_endpoints:
            raise InvalidParams("an election needs at least one etcd endpoint")
        check_cluster_id(self.cluster_id)
        if self.step_down_margin_ms < 0:
            raise InvalidParams(f"step-down margin {self.step_down_margin_ms} ms: give 0 or more")
        if not is_lease_ttl_ms(self.lease_ttl_ms, self.step_down_margin_ms):
            raise InvalidParams(
                f"lease TTL {self.lease_ttl_ms} ms: give whole seconds, "
                f"{lease_ttl_ms_min(self.step_down_margin_ms)} or more (a leader steps down "
                f"{self.step_down_margin_ms} ms before its lease can lapse)"
            )


class Elector:
    """One candidate's election loop: campaign, lead (keepalives), or watch; until stopped.

    Holds the etcd client, the `Leadership` (read by the server on every request) and the
    last leader record seen (`leader`, to tell clients where to go).
    """

    def __init__(
        self,
        config: ElectionConfig,
        record: LeaderRecord,
        listener: ElectionListener,
        *,
        clock_ms=lease_clock_ms,
    ) -> None:
        self.config = config
        self.record = record
        self.leadership = Leadership(config.step_down_margin_ms)
        self.leader: LeaderRecord | None = None
        self._listener = listener
        self._clock_ms = clock_ms
        self._etcd = EtcdClient(config.etcd_endpoints)
        self._key = leader_key(config.cluster_id)
        self._segments_key = segments_key(config.cluster_id)
        self._task: asyncio.Task[None] | None = None
        self._held_lease_id = 0
        self._is_of_cluster = False  # _claim_cluster found its mark the cluster's
        self._claiming: asyncio.Task[None] | None = None  # rotate_marks's claim
        self._is_stopped = False
        # Set (with the reason) when this candidate refuses to stand: see _claim_cluster.
        self.refusal: asyncio.Future[KVPoolError] | None = None
        # Why the last attempt to reach etcd failed, until one succeeds (the master's /health).
        self.etcd_error: str | None = None

    def __repr__(self) -> str:
        return f"<Elector {self.config.cluster_id} {self.record.endpoint} {self.leadership!r}>"

    def is_leader(self) -> bool:
        return self.leadership.is_leader(self._clock_ms())

    def start(self) -> None:
        assert self._task is None, "Elector started twice"
        self.refusal = asyncio.get_running_loop().create_future()
        self._task = asyncio.get_running_loop().create_task(
            self._run(), name=f"kvpool election {self.config.cluster_id}"
        )

    async def stop(self) -> None:
        """Stop campaigning; a leader revokes its lease so that a standby takes over at once.

        Bounded by one etcd request timeout.
        """
        self._is_stopped = True
        for task in (self._task, self._claiming):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        # _campaign's cleanup stepped down already; whatever the task was doing, no
        # leadership outlives stop(), whose revoke lets a standby win at once.
        self.leadership.step_down()
        if self._held_lease_id:
            await self._revoke_quietly(self._held_lease_id)
        await self._etcd.close()

    # --- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff_ms = _RETRY_BACKOFF_MS_MIN
        while True:  # Campaigns until stop() cancels it, or it refuses to stand.
            try:
                if not self._is_of_cluster:
                    await self._claim_cluster()
                await self._campaign()
                backoff_ms = _RETRY_BACKOFF_MS_MIN
            except InvalidParams as exc:
                log.error("election: %s", exc)
                assert self.refusal is not None
                self.refusal.set_result(exc)
                return
            except _ETCD_ERRORS as exc:
                self.etcd_error = f"{type(exc).__name__}: {exc}"
                delay_ms = backoff_ms // 2 + random.randrange(backoff_ms // 2 + 1)
                log.warning("election: etcd %s: %s: %s; retrying in %d ms",
                            ",".join(self.config.etcd_endpoints), type(exc).__name__, exc,
                            delay_ms)  # fmt: skip
                await asyncio.sleep(delay_ms / 1000)
                backoff_ms = min(backoff_ms * 2, limits.ELECTION_RETRY_BACKOFF_MS_MAX)

    def rotate_marks(self, marks: Sequence[str]) -> None:
        """The master's tokens were replaced (auth.Keyring): its first token's mark, then its
        others'. Claim the cluster again with them now, and until a claim with the latest
        succeeds (etcd unreachable meanwhile, or tokens replaced again), so that a master
        restarted with the first token alone finds the cluster's mark its own."""
        self.config = dataclasses.replace(self.config, cluster_mark=marks[0], also_marks=tuple(marks[1:]))
        if not self._is_stopped and (self._claiming is None or self._claiming.done()):
            self._claiming = asyncio.get_running_loop().create_task(self._claim_again())

    async def _claim_again(self) -> None:
        while True:
            config = self.config
            try:
                await self._claim_cluster()
            except (KVPoolError, CoordinationError) as exc:
                log.warning("cluster %s on etcd: its mark not updated for the new token yet (%s); trying again "
                            "in %d s", config.cluster_id, exc, limits.CLUSTER_MARK_RETRY_MS // 1000)  # fmt: skip
                await asyncio.sleep(limits.CLUSTER_MARK_RETRY_MS / 1000)
                continue
            if self.config is config:
                return

    async def _claim_cluster(self) -> None:
        """Check that this candidate's cluster token is the cluster's (its mark in etcd, set by
        the first candidate). A master with another token stood by without a word, and once it
        led, every client and node was refused: a failover became an outage (helper-49).

        Raises:
            InvalidParams: the cluster's masters have another token.
        """
        while True:
            config = self.config
            mark, key = config.cluster_mark, mark_key(config.cluster_id)
            created, holder, _ = await self._etcd.create(key, mark.encode(), lease_id=0)
            held = "" if created or holder is None else holder.value.decode(errors="replace")
            if held and held != mark and held in config.also_marks:
                await self._etcd.put(key, mark.encode())  # the token rotated: the cluster's mark follows
                log.info("cluster %s on etcd: its mark is now this master's first token's (%s)",
                         config.cluster_id, mark[:8])  # fmt: skip
            elif held and held != mark:
                raise InvalidParams(
                    f"cluster {config.cluster_id} on etcd has masters with another cluster token: this master "
                    f"will not stand for election (give every master, node and client one token; after changing "
                    f"it, delete the key {mark_key(config.cluster_id).decode()} in etcd)"
                )
            if self.config is config:
                break
            # Tokens replaced meanwhile (rotate_marks): the claim of the latest may have run
            # beside this one, and this one's put of an older mark landed after it (review
            # helper-154). Claim again with the latest: the last write is then its mark.
        self._is_of_cluster = True

    async def _campaign(self) -> None:
        """One round: try to create the leader key; lead until deposed, or watch it."""
        etcd = self._etcd
        sent_ms = self._clock_ms()
        lease_id, ttl_ms = await etcd.grant_lease(self.config.lease_ttl_ms)
        self.etcd_error = None
        try:
            created, holder, revision = await etcd.create(
                self._key, self.record.encode(), lease_id=lease_id
            )
        except BaseException:
            await self._revoke_quietly(lease_id)
            raise
        if not created:
            await self._revoke_quietly(lease_id)
            if holder is not None:
                leader = LeaderRecord.decode(holder.value)
                if leader.candidate_id == self.record.candidate_id:
                    # This process's own record, of a term it no longer leads: its lease could
                    # not be revoked at the step-down (etcd was down) and etcd, restarted, kept
                    # it. No other candidate holds this id: give it up now, and campaign again,
                    # rather than stand by for the lease to lapse naming itself as the leader.
                    log.info("election: the leader key holds this master's previous term; revoking its lease")
                    await self._revoke_quietly(holder.lease_id)
                    # Campaign again once the key went: at once if the revoke took, else when
                    # the lease lapses (not in a loop of leases granted and revokes refused).
                    await etcd.wait_for_change(self._key, revision, limits.ETCD_WATCH_TIMEOUT_MS)
                    return
                self.leader = leader
                log.info("election: %s leads cluster %s (term %d); standing by",
                         self.leader.endpoint, self.config.cluster_id,
                         holder.create_revision)  # fmt: skip
                await etcd.wait_for_change(self._key, revision, limits.ETCD_WATCH_TIMEOUT_MS)
            return
        self._held_lease_id = lease_id
        self.leadership.elect(lease_id, revision, ttl_ms, sent_ms)
        self.leader = self.record
        reason = "master stopping"
        try:
            # Before any await: from is_leader() on, the server answers with the term's state,
            # closed to puts and removes. It answered as an open leader, on a service it then
            # threw away, while the record below was read: a remove taken then missed the
            # replicas of a node that re-mounted later, and the object came back.
            self._listener.elected(revision)
            expected = await self._read_expected()
            log.info("election: elected leader of cluster %s (term %d, lease %x, %s segments to "
                     "wait for)", self.config.cluster_id, revision, lease_id,
                     "unknown" if expected is None else len(expected))  # fmt: skip
            self._listener.predecessor_record(expected)
            reason = await self._lead(lease_id, revision)
        finally:
            self.leadership.step_down()
            if self.leader is self.record:
                self.leader = None
            log.warning("election: stepped down as leader of cluster %s (term %d): %s",
                        self.config.cluster_id, revision, reason)  # fmt: skip
            self._listener.deposed(reason)
        # Not cancelled: give the lease up, so that a successor need not wait for it to lapse.
        self._held_lease_id = 0
        await self._revoke_quietly(lease_id)

    async def _lead(self, lease_id: int, term: int) -> str:
        """Keep the lease alive and the record current; returns why leadership ended.

        The segment record is checked every SEGMENT_RECORD_CHECK_MS, not only at keepalives
        (every 1.7 s by default): a successor waits for every segment the record names, up to
        the re-mount grace, and one that left just before this leader died cost a failover
        those 3 s (seen in the chaos suite: 8.1 s against a 10 s target)."""
        etcd, leadership = self._etcd, self.leadership
        interval_ms = self._keepalive_interval_ms()
        published: list[str] | None = None
        keepalive_at_ms = self._keepalive_due_ms(self._clock_ms())
        is_etcd_answering = True  # else only keepalives are tried (and logged), not records
        while True:  # Ends when leadership ends (returns) or the elector stops (cancelled).
            now_ms = self._clock_ms()
            if not leadership.is_leader(now_ms):
                return "no keepalive succeeded before the step-down deadline"
            wait_ms = min(keepalive_at_ms - now_ms, SEGMENT_RECORD_CHECK_MS, leadership.remaining_ms(now_ms))
            await asyncio.sleep(max(0, wait_ms) / 1000)
            sent_ms = self._clock_ms()
            remaining_ms = leadership.remaining_ms(sent_ms)
            if remaining_ms == 0:
                return "no keepalive succeeded before the step-down deadline"
            try:
                if sent_ms >= keepalive_at_ms:
                    keepalive_at_ms = sent_ms + interval_ms // 2  # sooner again if this one fails
                    ttl_ms = await etcd.keep_alive(lease_id, timeout_ms=remaining_ms)
                    if ttl_ms == 0:
                        return "etcd says the lease has expired"
                    leadership.renew(ttl_ms, sent_ms)
                    kv, _ = await etcd.get(
                        self._key, timeout_ms=max(1, leadership.remaining_ms(self._clock_ms()))
                    )
                    if kv is None or kv.lease_id != lease_id:
                        return "the leader key is gone or held under another lease"
                    keepalive_at_ms = self._keepalive_due_ms(sent_ms)
                    is_etcd_answering = True
                segment_ids = self._listener.live_segment_ids()
                if is_etcd_answering and segment_ids is not None and segment_ids != published:
                    if len(segment_ids) > limits.LEADER_RECORD_SEGMENTS_MAX:
                        log.warning("election: %d segments: too many to record", len(segment_ids))
                    elif not await etcd.put_if_held(self._key, lease_id, self._segments_key,
                                                    encode_segments_record(term, segment_ids)):  # fmt: skip
                        return "fenced out of the segment record: the leader key is not ours"
                    published = segment_ids
            except _ETCD_ERRORS as exc:
                is_etcd_answering = False
                log.warning("election: keepalive or segment record failed (%s: %s); stepping down "
                            "in %d ms unless a keepalive succeeds", type(exc).__name__, exc,
                            leadership.remaining_ms(self._clock_ms()))  # fmt: skip

    def _keepalive_interval_ms(self) -> int:
        return self.config.lease_ttl_ms // limits.ETCD_KEEPALIVES_PER_TTL

    def _keepalive_due_ms(self, after_ms: int) -> int:
        """When to send the next keepalive: an interval after `after_ms`, and no later than
        an interval before the step-down deadline, so that one has time to succeed. The first
        was due an interval after _lead began, while the deadline runs from the grant's send:
        an election that took over TTL - margin - interval (1 s at the 3 s minimum TTL: one
        etcd request timeout) stepped down without sending any."""
        interval_ms = self._keepalive_interval_ms()
        return min(after_ms + interval_ms, self.leadership.valid_until_ms - interval_ms)

    async def _read_expected(self) -> list[str] | None:
        # Bounded so that the first keepalive, due an interval before the deadline, is sent
        # in time (each etcd member may take its request timeout, 1 s).
        now_ms = self._clock_ms()
        timeout_ms = self._keepalive_due_ms(now_ms) - now_ms
        if timeout_ms <= 0:
            log.warning("election: no time left to read the segment record; waiting the full grace")
            return None
        try:
            kv, _ = await self._etcd.get(self._segments_key, timeout_ms=timeout_ms)
        except _ETCD_ERRORS as exc:
            log.warning("election: cannot read the segment record (%s); waiting the full grace", exc)
            return None
        if kv is None:
            return []
        try:
            return decode_segments_record(kv.value)
        except CoordinationError as exc:
            log.warning("election: %s; waiting the full grace", exc)
            return None

    async def _revoke_quietly(self, lease_id: int) -> None:
        try:
            await self._etcd.revoke_lease(lease_id)
        except _ETCD_ERRORS as exc:
            log.info("election: lease %x not revoked (%s); it lapses by itself", lease_id, exc)


__all__ = ["ElectionConfig", "ElectionListener", "Elector", "Leadership", "Role", "lease_clock_ms"]
