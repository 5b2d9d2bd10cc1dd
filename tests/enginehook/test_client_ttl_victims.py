"""Memory-pressure victims weigh a client's TTL and a learned one on one scale: the vLLM
hook's decider (:class:`enginehook.vllm.services.HookServices`) prices a client-TTL pin
with the cost model's B and F = 1, so a learned pin (F < 1) of the same size and context
goes first, in the pressure path and in a newcomer's first-turn reclaim alike."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from enginehook.config import HookConfig
from enginehook.core.host import FinishedTurn
from enginehook.core.lifecycle import PinController
from enginehook.core.rules import SchedulingRules
from enginehook.vllm.services import HookServices
from tests.enginehook.hosts import MinimalHost

CONTEXT = 100_000  # a context whose rebuild the cold start prices well above 1 s


@pytest.fixture
def controller() -> Iterator[tuple[PinController[str], MinimalHost]]:
    services = HookServices(HookConfig(), None)
    host = MinimalHost()
    controller = PinController(
        SchedulingRules(), host, pool_blocks=100, decider=services, engine_id="t"
    )
    learned = FinishedTurn("learned", "bash", "ls", CONTEXT)
    controller.arrived("learned", 0.0, 0.0)
    controller.finished(learned, 0.0, lambda: (10, "learned"))
    (pin,) = list(controller.pins)
    client = FinishedTurn("client", "bash", "ls", CONTEXT, pin_ttl_s=pin.ttl_s)
    controller.arrived("client", 0.0, 0.0)
    controller.finished(client, 0.0, lambda: (10, "client"))
    yield controller, host
    services.close()


def _pins(controller: PinController[str]) -> dict[str, object]:
    return {p.program_id: p for p in controller.pins}


def test_a_client_ttl_pin_carries_a_price(controller) -> None:
    c, _ = controller
    pins = _pins(c)
    learned, client = pins["learned"], pins["client"]
    assert client.basis == "client"  # type: ignore[attr-defined]
    assert client.return_probability == 1.0  # type: ignore[attr-defined]
    assert client.benefit_s == pytest.approx(learned.benefit_s)  # type: ignore[attr-defined]
    assert client.benefit_s > 0  # type: ignore[attr-defined]
    assert client.expected_loss_s(0.5) > learned.expected_loss_s(0.5) > 0  # type: ignore[attr-defined]


def test_the_learned_pin_goes_first_under_pressure(controller) -> None:
    c, host = controller
    assert c.relieve(10, "x", for_running=True, nothing_running=False, now=0.5) == 1
    assert host.freed == [("learned", "pressure")]
    assert c.pinned("client")


def test_a_newcomer_reclaims_client_and_learned_pins_alike(controller) -> None:
    c, host = controller
    released = c.relieve(20, "n", for_running=False, nothing_running=False, now=0.5, waited_s=100.0)
    assert released == 2
    assert [program for program, _ in host.freed] == ["learned", "client"]
