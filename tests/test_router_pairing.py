"""The pairing port: the table follows the view, and a load digest does not rebuild it."""

from __future__ import annotations

import time

import msgspec
import pytest
from standins_fleet import StaticView, live_member

from router.choice import NO_AFFINITY
from router.inflight import InFlight
from router.latency import LatencyTracker
from router.metrics import RouterMetrics
from router.pairing import Pairing
from router.policies import make_pairer
from router.quarantine import Quarantine
from router.table import PairingTable
from wire.protocol import Load, MemberState, Role

P, D = Role.PREFILL, Role.DECODE


def pairing_over(view: StaticView) -> Pairing:
    metrics = RouterMetrics()
    latency = LatencyTracker()
    return Pairing(view, make_pairer("least_loaded", latency=latency), locality_label="",
                   protocols={"vllm-nixl"}, quarantine=Quarantine(5.0),
                   in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                   latency=latency, clock=time.monotonic)


def fleet(n: int) -> dict[str, object]:
    members = {f"p{i}": live_member(f"p{i}", P, f"http://10.0.0.{i}:8000") for i in range(n)}
    members.update({f"d{i}": live_member(f"d{i}", D, f"http://10.0.1.{i}:8000")
                    for i in range(n)})
    return members


def test_a_load_digest_updates_loads_without_rebuilding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    view = StaticView(fleet(3))  # type: ignore[arg-type]
    pairing = pairing_over(view)
    first = pairing.table()
    builds = []
    build = PairingTable.build
    monkeypatch.setattr(PairingTable, "build", classmethod(
        lambda cls, *a, **k: builds.append(1) or build(*a, **k)))
    # A digest: d1 is busy now. The same record, a new load (what the view does).
    members = dict(view.members())
    busy = Load(running=40, waiting=10)
    members["d1"] = msgspec.structs.replace(members["d1"], load=busy, load_at=time.monotonic())
    view.set(members)
    table = pairing.table()
    assert builds == []
    decodes = {c.id: c for c in table.pools["m"][0].decodes}
    assert decodes["d1"].queue == 50
    assert decodes["d0"] is first.pools["m"][0].decodes[0]  # untouched candidates kept
    picks = {pairing.choose("m", NO_AFFINITY, ()).decode.id for _ in range(30)}
    assert "d1" not in picks  # least loaded sees the new load


@pytest.mark.parametrize("change", ["join", "leave", "state"])
def test_a_membership_change_rebuilds(change: str) -> None:
    view = StaticView(fleet(2))  # type: ignore[arg-type]
    pairing = pairing_over(view)
    pairing.table()
    members = dict(view.members())
    if change == "join":
        members["d9"] = live_member("d9", D, "http://10.0.1.9:8000")
    elif change == "leave":
        del members["d1"]
    else:
        members["d1"] = live_member("d1", D, "http://10.0.1.1:8000",
                                    state=MemberState.DRAINING)
    view.set(members)
    decodes = {c.id for c in pairing.table().pools["m"][0].decodes}
    assert decodes == {"join": {"d0", "d1", "d9"}, "leave": {"d0"}, "state": {"d0"}}[change]


def test_a_requests_first_pair_is_told_with_its_prediction_retries_are_not() -> None:
    """What the `kv` policy counts (prompt tokens routed, predicted cached) comes with the
    pair the request got first, not from the pairer's state, and once per request."""
    metrics = RouterMetrics()
    latency = LatencyTracker()
    told: list[tuple[str, object, object]] = []
    view = StaticView(fleet(2))  # type: ignore[arg-type]
    pairing = Pairing(view, make_pairer("least_loaded", latency=latency),
                      locality_label="", protocols={"vllm-nixl"}, quarantine=Quarantine(5.0),
                      in_flight=InFlight(metrics.in_flight_of), picks_of=metrics.picks_of,
                      latency=latency, clock=time.monotonic,
                      on_first_pair=lambda *args: told.append(args))
    first = pairing.choose("m", NO_AFFINITY, ())
    assert first is not None and told == [("m", NO_AFFINITY, first)]
    assert first.cached_tokens == 0 and not first.exact  # least_loaded predicts nothing
    assert pairing.choose("m", NO_AFFINITY, (first.prefill.id,)) is not None  # a retry
    assert pairing.choose("nobody", NO_AFFINITY, ()) is None
    assert len(told) == 1


def test_a_choice_and_admissions_candidates_ask_the_view_for_their_models_loads() -> None:
    """A view with loads on demand applies the loads of the models asked for: both reads
    a request makes of a model's pools ask for it, and for no other model; a name no
    member serves is not asked for (a client could make up any number of them)."""
    view = StaticView(fleet(2))  # type: ignore[arg-type]
    pairing = pairing_over(view)
    pairing.candidates("m")
    pairing.choose("m", NO_AFFINITY, ())
    assert pairing.choose("a-name-a-client-made-up", NO_AFFINITY, ()) is None
    assert view.asked == ["m", "m"]  # (names nobody serves are not held)
