"""The pairing port: which pair serves a request, given what the router knows now.

`Pairing` keeps the pairing table current with the view's changes (router/table_updater.py:
a load digest swaps the candidates it names, a membership change makes that model's
pools again; nothing walks the whole view but its first read), and asks the policy for a pair with
the router's own in-flight counts and local quarantine. It is what a `Proxy` holds to
choose and hold pairs (router/ports.py: `PairingPort`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

from registry.client import LiveMember
from registry.view_changes import Changes
from router.choice import Affinity
from router.inflight import Hold, InFlight
from router.latency import LatencyTracker
from router.metrics import SeriesOf
from router.policies import Pairer
from router.quarantine import Quarantine
from router.table import Candidate, Pair, PairingTable, ProtocolPool, eligible, served
from router.table_updater import TableUpdater
from wire.protocol import Role

__all__ = ["MAX_KNOWN_MODELS", "BudgetPort", "MembersChanged", "MembershipSource", "Pairing"]

MAX_KNOWN_MODELS: Final = 10_000  # models remembered for 404-vs-503 (registry-bounded)


# on_members(members, moved): membership changed; `moved`, the ids that joined, left or
# have a new record (None: every member, read whole)
MembersChanged = Callable[[Mapping[str, LiveMember], Collection[str] | None], None]


class MembershipSource(Protocol):
    """What the router needs of `registry.client.MembershipView`."""

    @property
    def synced(self) -> bool:
        """A registry has given a snapshot at least once (the view knows something)."""

    def members(self) -> Mapping[str, LiveMember]: ...
    def changes(self, since: int) -> Changes[LiveMember]:
        """The view's version and members, and the ids changed after version `since`
        (registry/view_changes.py)."""

    def loads(self, model: str, after: int, upto: int) -> Collection[str] | None:
        """The ids of `model` whose load alone changed in versions (after, upto] (None:
        not known any more); those are not in `changes` (registry/view_changes.py)."""

    def loads_confirmed_at(self, model: str) -> float:
        """When a registry last confirmed `model`'s loads unchanged (monotonic)."""

    def ask(self, model: str) -> None:
        """`model`'s loads are about to be read (a request for it): keep them current
        (a view with loads on demand holds back the loads of models nobody asks for)."""

    def report(self, member_id: str, incarnation: int, problem: str) -> None:
        """Queue a failure report for the registries; must not block (called on the loop)."""


class BudgetPort(Protocol):
    """What pairing asks of admission (router/admission/shares.py `Shares`)."""

    def full(self, model: str, ticket: Any = None) -> Collection[str]:
        """Members of `model` with no budget left for the request holding `ticket`:
        chosen only if no other is eligible."""

    def charge(self, ticket: Any, pair: Pair) -> tuple[Any, Any]:
        """The request's budget grants on `pair` (decode's, prefill's or None), each with
        a `release()`."""


class Pairing:
    def __init__(self, view: MembershipSource, pairer: Pairer, *, locality_label: str,
                 protocols: Collection[str], quarantine: Quarantine, in_flight: InFlight,
                 picks_of: SeriesOf, latency: LatencyTracker,
                 clock: Callable[[], float],
                 on_members: MembersChanged | None = None,
                 on_first_pair: Callable[[str, Affinity, Pair], None] | None = None,
                 budgets: BudgetPort | None = None) -> None:
        """`on_members(members, moved)`: called whenever membership (not only loads)
        changed, before the next choice, with the ids that joined, left or have a new
        record (None: look at every member; the first time, or after the view lost
        count): the `kv` policy follows its publishers.
        `on_first_pair(model, affinity, pair)`: called with each request's first pair,
        not with a retry's or a migration's (the `kv` policy counts the prompt tokens
        routed and those the pair predicts cached). `budgets`: admission's, when it is on
        (members without budget are avoided; a held pair is charged)."""
        self.view = view
        self.pairer = pairer
        self.quarantine = quarantine
        self.in_flight = in_flight
        self._picks_of = picks_of
        self._latency = latency
        self._clock = clock
        self._on_members = on_members
        self._on_first_pair = on_first_pair
        self._budgets = budgets
        self._seen: Mapping[str, LiveMember] = {}
        self._version = -1  # of the view the table follows (-1: none read yet)
        self._updater = TableUpdater(locality_label, protocols, view.loads)
        self._known_models: set[str] = set()

    def table(self) -> PairingTable:
        """The pairing table for the current membership, every model's loads in (what
        `PairingTable.build` makes of the view). A request reads its own model's pools
        instead (`choose`, `candidates`): this costs the loads waiting in every model's."""
        self.follow()
        return self._updater.table

    def follow(self) -> None:
        """Bring the table up to date with what changed in the view since the version it
        follows (free when nothing did): membership changes remake their models' pools
        and reach `on_members`; loads wait until their model's pools are read."""
        changes = self.view.changes(self._version)
        if changes.version == self._version:
            return
        members = changes.members
        if changes.changed is None:
            update = self._updater.reset(members, changes.version)
        else:
            update = self._updater.apply(self._seen, members, changes.changed,
                                         changes.version)
        self._seen = members
        self._version = changes.version
        moved = update.moved
        if moved is None:
            self._latency.retain(members.keys())
        else:
            self._latency.forget(update.gone)
            if not moved:
                return  # loads alone
        self._learn_models(members.values() if moved is None
                           else (members[i] for i in moved if i in members))
        if self._on_members is not None:
            self._on_members(members, moved)

    def _table_of(self, model: str) -> PairingTable:
        """A table of `model` alone, its loads current: what a choice for `model` reads
        (other models' loads are not swapped in for it)."""
        pools = self._pools_of(model)
        return PairingTable({model: pools} if pools else {})

    def _pools_of(self, model: str) -> tuple[ProtocolPool, ...]:
        """`model`'s pools, its loads as current as the view has them. The view is asked
        for the loads of a model a member serves only: a model name is the client's to
        choose, and each one asked for is held for a while."""
        self.follow()
        if self._updater.serves(model):
            self.view.ask(model)
        return self._updater.pools_of(model)

    def _learn_models(self, members: Iterable[LiveMember]) -> None:
        """Remember the models engines serve (for 404-vs-503), up to MAX_KNOWN_MODELS."""
        if len(self._known_models) < MAX_KNOWN_MODELS:
            self._known_models.update(name for m in members
                                      if m.record.spec.role is not Role.API_SERVER
                                      for name in served(m.record.spec))

    def routable_urls_since(self, mark: int) -> tuple[int, list[str]]:
        """The base URLs that became routable after `mark` (0: every routable one), and
        the mark to pass next time (router/warmup.py): costs the URLs that arrived."""
        self.follow()
        return self._updater.urls_since(mark)

    def serves(self, model: str) -> bool:
        """A member serves `model` now (it has a pool in the table)."""
        return self._updater.serves(model)

    def knows(self, model: str) -> bool:
        self.follow()
        return model in self._known_models

    def models(self) -> list[str]:
        """Models with an eligible P and D right now (for /v1/models)."""
        self.follow()  # eligibility is membership's: no load needs swapping in
        return self._updater.membership.models(self.quarantine.active(self._clock()))

    def choose(self, model: str, affinity: Affinity, tried: Collection[str], *,
               despite_quarantine: bool = False, ticket: Any = None) -> Pair | None:
        """`ticket`: admission's for the request (the members it reserved room on are
        not full for it)."""
        now = self._clock()
        quarantined = None if despite_quarantine else self.quarantine.active(now)
        exclude: Collection[str] = tried
        if self._budgets is not None:
            full = self._budgets.full(model, ticket)
            if full:
                exclude = {*tried, *full}
        pair = self.pairer.choose(self._table_of(model), model, now=now,
                                  in_flight=self.in_flight.counts, quarantined=quarantined,
                                  exclude=exclude, affinity=affinity,
                                  loads_confirmed_at=self.view.loads_confirmed_at(model))
        if pair is not None and not tried and self._on_first_pair is not None:
            self._on_first_pair(model, affinity, pair)
        return pair

    def candidates(self, model: str) -> tuple[Sequence[Candidate], Sequence[Candidate]]:
        """The eligible prefills and decodes of `model` (routable, else suspect; not
        quarantined), over every protocol pool."""
        pools = self._pools_of(model)
        quarantined = self.quarantine.active(self._clock())
        prefills: list[Candidate] = []
        decodes: list[Candidate] = []
        for pool in pools:
            prefills.extend(eligible(pool.prefills, pool.prefills_suspect, quarantined))
            decodes.extend(eligible(pool.decodes, pool.decodes_suspect, quarantined))
        return prefills, decodes

    def hold(self, pair: Pair, ticket: Any = None) -> tuple[Hold, Hold | None]:
        """Count the pick; an in-flight slot on D, and on P unless it is D itself. With
        admission's `ticket`, the slots carry the request's budget on the pair."""
        decode_grant = prefill_grant = None
        if ticket is not None and self._budgets is not None:
            decode_grant, prefill_grant = self._budgets.charge(ticket, pair)
        picks = self._picks_of
        picks(pair.decode.id, "decode").inc()
        decode = self.in_flight.hold(pair.decode.id, decode_grant and decode_grant.release)
        if pair.direct:
            return decode, None
        picks(pair.prefill.id, "prefill").inc()
        return decode, self.in_flight.hold(pair.prefill.id,
                                           prefill_grant and prefill_grant.release)
