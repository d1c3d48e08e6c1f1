"""The in-flight save registry (:mod:`objckpt.in_flight`): pure, no store."""

from __future__ import annotations

import concurrent.futures

from objckpt import in_flight


def test_a_save_counts_until_its_future_ends_under_every_spelling_of_its_url(tmp_path):
    url = f"file://{tmp_path}/ckpt"
    first: concurrent.futures.Future[None] = concurrent.futures.Future()
    second: concurrent.futures.Future[None] = concurrent.futures.Future()
    assert not in_flight.save_in_flight(url)
    in_flight.track(url, first)
    in_flight.track(f"{tmp_path}/ckpt/", second)  # the same location, spelt as a path
    for spelling in (url, url + "/", f"{tmp_path}/ckpt"):
        assert in_flight.save_in_flight(spelling)
    assert not in_flight.save_in_flight(f"{tmp_path}/other")
    first.set_result(None)
    assert in_flight.save_in_flight(url)  # the second save still runs
    second.set_exception(RuntimeError("failed"))  # a save that fails ends too
    assert not in_flight.save_in_flight(url)
