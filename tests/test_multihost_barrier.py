"""A barrier that times out names the processes that did not arrive, whatever the key-value store says."""

from __future__ import annotations

import pytest

from objckpt import multihost
from objckpt.errors import CoordinationError

SERVICE_ERROR = (
    "DEADLINE_EXCEEDED: Barrier timed out. Id: op/sizes-barrier::0.\n"
    "# of tasks that reached the barrier: 1/3.\n"
    "The first task at the barrier: 0. Some timed out task names:\n2\n\n"
)


class _Client:
    """The coordination client's calls a barrier makes, with the arrival keys given."""

    def __init__(self, arrived: list[int] | None) -> None:
        self.keys: dict[str, str] = {f"b/arrived/{p}": "1" for p in arrived or []}
        self.refuse_reads = arrived is None

    def key_value_set(self, key: str, value: str) -> None:
        self.keys[key] = value

    def wait_at_barrier(self, name: str, timeout_ms: int) -> None:
        raise RuntimeError(SERVICE_ERROR)

    def key_value_dir_get(self, prefix: str) -> list[tuple[str, str]]:
        if self.refuse_reads:
            raise RuntimeError("UNAVAILABLE: the service has declared a task dead")
        return [(k, v) for k, v in self.keys.items() if k.startswith(prefix)]


@pytest.mark.parametrize(
    ("arrived", "named"),
    [
        ([0, 1], "2"),  # process 2 never marked its arrival: the keys name it
        ([0, 1, 2], "2"),  # process 2 marked its arrival, then died before waiting: the service names it
        (None, "2"),  # the service refuses every read: its error names it
    ],
)
def test_a_timed_out_barrier_names_the_process_that_did_not_arrive(arrived: list[int] | None, named: str) -> None:
    coordinator = multihost._JaxCoordinator(_Client(arrived), process_index=0, process_count=3)
    with pytest.raises(CoordinationError) as caught:
        coordinator.barrier("b", timeout=1)
    assert f"processes that did not arrive: {named} (" in str(caught.value)
