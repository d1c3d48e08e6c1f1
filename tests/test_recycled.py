"""Host buffers of boxes bound for an accelerator, lent and taken back once copied
(``objckpt.restoring.recycled``, ``objckpt.restoring.copies_in_flight``).

The suite has no accelerator: the restores here give their plans an accelerator's traits
(``on_host=False``, ``recycles=True``) and their landing devices whose copies end late,
when the test says so, so a buffer given back before its copy ended is caught.
"""

from __future__ import annotations

import dataclasses
import random

import jax
import numpy as np
import pytest
from helpers import full_manifest
from restore_seams import paths, restore_with

import objckpt
from objckpt.restoring.copies_in_flight import CopiesInFlight, copies_ended
from objckpt.restoring.landing import Devices, Landing
from objckpt.restoring.leaf_plan import plan_leaf
from objckpt.restoring.recycled import GRANULE, SMALLEST, RecycledBuffers
from objckpt.storage import from_url

MiB = 1 << 20


def _address(array: np.ndarray) -> int:
    return array.__array_interface__["data"][0]


def test_a_buffer_given_back_serves_the_next_box_of_its_size():
    """The mapping under a buffer given back is the next box's memory; a box of another
    dtype and shape that fits takes it too, and nothing is mapped anew."""
    made: list[int] = []

    def mapped(n):
        made.append(n)
        return np.zeros(n, np.uint8)

    pool = RecycledBuffers(keep=64 * MiB, mapped=mapped)
    first, fresh = pool.take((1024, 1024), np.float32)  # 4 MiB
    assert fresh is not None and first.shape == (1024, 1024) and first.dtype == np.float32
    assert made == [4 * MiB] and pool.lent == 1
    pool.give_back([first])
    second, again = pool.take((2048, 1024), np.float16)  # 4 MiB too
    assert again is None and _address(second) == _address(first)
    assert (pool.made, pool.reused, pool.held) == (1, 1, 4 * MiB)


def test_fresh_mappings_round_up_and_small_boxes_take_numpy_memory():
    pool = RecycledBuffers(mapped=lambda n: np.zeros(n, np.uint8))
    odd, fresh = pool.take((MiB + 5,), np.uint8)
    assert fresh is not None and fresh.nbytes == 2 * GRANULE and odd.nbytes == MiB + 5
    small, none = pool.take((SMALLEST // 8 - 1,), np.float64)
    assert none is None and pool.lent == 1  # not lent: never comes back
    pool.give_back([small])  # ignored, as is anything else it did not lend
    pool.give_back([np.zeros(4 * MiB, np.uint8)])
    assert pool.lent == 1 and pool.held == 2 * GRANULE


def test_a_large_free_mapping_is_kept_for_a_large_box():
    """A box does not take a free mapping over twice its size: that stays for a box that needs it."""
    pool = RecycledBuffers(keep=1 << 30, mapped=lambda n: np.zeros(n, np.uint8))
    big, _ = pool.take((64 * MiB,), np.uint8)
    pool.give_back([big])
    small, fresh = pool.take((4 * MiB,), np.uint8)
    assert fresh is not None and _address(small) != _address(big)
    large, again = pool.take((40 * MiB,), np.uint8)
    assert again is None and _address(large) == _address(big)


def test_free_mappings_past_keep_are_let_go():
    pool = RecycledBuffers(keep=8 * MiB, mapped=lambda n: np.zeros(n, np.uint8))
    lent = [pool.take((4 * MiB,), np.uint8)[0] for _ in range(4)]
    assert pool.held == 16 * MiB
    pool.give_back(lent)
    assert pool.held == 8 * MiB and pool.lent == 0  # two kept, two let go
    assert [pool.take((4 * MiB,), np.uint8)[1] is None for _ in range(3)] == [True, True, False]


def test_ended_copies_give_their_buffers_back_before_a_fresh_mapping_is_made():
    """No free mapping fits: the copies that have ended meanwhile are asked for theirs first."""
    ended: dict[int, bool] = {}
    pool = RecycledBuffers(mapped=lambda n: np.zeros(n, np.uint8))
    copies = CopiesInFlight(1 << 40, ready=lambda token: ended[token], done=pool.give_back)
    pool._ended = copies.release_ended
    a, _ = pool.take((4 * MiB,), np.uint8)
    b, _ = pool.take((4 * MiB,), np.uint8)
    ended.update({1: False, 2: True})
    copies.started(1, a.nbytes, [a])
    copies.started(2, b.nbytes, [b])
    assert pool.take((4 * MiB,), np.uint8)[1] is not None  # b's copy ended, a's did not: in order
    ended[1] = True
    reused, fresh = pool.take((4 * MiB,), np.uint8)
    assert fresh is None and _address(reused) in (_address(a), _address(b))


def test_a_copy_has_ended_when_every_array_of_it_is_ready():
    """The default readiness check: every array of the pytree says it is ready; an object
    that cannot say (no ``is_ready``) counts as still copying, so its buffers are never lent again early."""

    class Copying:
        def is_ready(self):
            return False

    done = jax.device_put(np.ones(4))
    assert copies_ended([done, {"b": done}])
    assert not copies_ended([done, Copying()])
    assert not copies_ended([done, object()])


def test_copies_past_the_window_hand_their_buffers_back_in_order():
    done: list[str] = []
    waited: list[int] = []
    copies = CopiesInFlight(8, wait=waited.append, ready=lambda token: False, done=lambda hosts: done.extend(hosts))
    copies.started(1, 4, ["a"])
    copies.started(2, 4, [])
    copies.started(3, 4, ["c"])  # 12 bytes: the oldest is waited for
    assert waited == [1] and done == ["a"]
    copies.started(4, 8, ["d"])
    assert waited == [1, 2, 3] and done == ["a", "c"]


class _LateCopies:
    """Landing devices whose copies end only when a random draw or a wait says so, and that
    record, for every host buffer address, whether a copy from it is still running."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.running: dict[int, int] = {}  # host address → copies from it still running
        self.sources: dict[int, list[int]] = {}  # id(device array) → the host addresses it copied
        self.early: list[int] = []  # addresses lent again while a copy from them ran

    def put(self, x, device=None, **kwargs):
        hosts = x if isinstance(x, list) else [x]
        out = jax.device_put([np.array(h, copy=True) for h in hosts], device, **kwargs)  # never aliases the host
        for host, array in zip(hosts, out):
            address = _address(host)
            self.running[address] = self.running.get(address, 0) + 1
            self.sources[id(array)] = [address]
        return out if isinstance(x, list) else out[0]

    def from_callback(self, shape, sharding, callback):
        boxes: list[int] = []

        def copied(index):
            host = callback(index)
            boxes.append(_address(host))
            self.running[boxes[-1]] = self.running.get(boxes[-1], 0) + 1
            return np.array(host, copy=True)

        out = jax.make_array_from_callback(shape, sharding, copied)
        self.sources[id(out)] = boxes
        return out

    def _end(self, arrays) -> None:
        for array in jax.tree.leaves(arrays):
            for address in self.sources.pop(id(array), []):
                self.running[address] -= 1

    def ended(self, arrays) -> bool:
        if self.rng.random() < 0.7:
            return False
        self._end(arrays)
        return True

    def wait(self, arrays):
        self._end(arrays)
        return arrays

    def devices(self) -> Devices:
        return Devices(put=self.put, from_callback=self.from_callback, wait=self.wait, ended=self.ended)


@pytest.mark.parametrize("whole_leaf_bytes", [0, 64 * MiB], ids=["box-by-box", "whole-leaf"])
def test_an_accelerator_restore_reuses_buffers_only_after_their_copies_end(tmp_path, whole_leaf_bytes):
    """48 leaves of 2 MiB bound for an accelerator, two boxes each, streamed 8 MiB at a time
    through a 4 MiB copy window, whose copies each end only once a wait or a 30 % draw says
    so: the restore is exact, many boxes land in memory an earlier box was copied from,
    none before that copy ended, and the memory held at once stays
    near the window, not the state."""
    mesh = jax.make_mesh((2,), ("d",), devices=jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))
    tree = {f"w{i:02d}": jax.device_put(np.full((1024, 512), i, np.float32), sharding) for i in range(48)}
    objckpt.save(tmp_path.as_uri(), tree, options=objckpt.Options(blob_size=4 * MiB))
    late = _LateCopies(seed=whole_leaf_bytes)
    made: list[Landing] = []

    class Checked(Landing):
        def __init__(self, plans, **kwargs):
            super().__init__(plans, transfer_window=4 * MiB, **kwargs)
            made.append(self)
            take = self.recycled.take

            def checked_take(shape, dtype):
                buffer, fresh = take(shape, dtype)
                if fresh is None and late.running.get(_address(buffer), 0):
                    late.early.append(_address(buffer))
                return buffer, fresh

            self.recycled.take = checked_take

    target = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding) for k, v in tree.items()}
    out = restore_with(
        from_url(tmp_path.as_uri()),
        paths(target),
        options=objckpt.Options(read_chunk=4 * MiB, streamed_window=8 * MiB),
        devices=late.devices(),
        landing=Checked,
        whole_leaf_bytes=whole_leaf_bytes,
        replan=lambda plan: dataclasses.replace(plan, on_host=False, recycles=True),
    )
    for k, v in tree.items():
        np.testing.assert_array_equal(np.asarray(out[f"['{k}']"]), np.asarray(v), err_msg=k)
    pool = made[-1].recycled
    assert late.early == [], "a buffer was lent again while a copy from it still ran"
    assert pool.reused >= 48 and pool.made + pool.reused == 96, (pool.made, pool.reused)
    assert pool.held_peak <= 32 * MiB, pool.held_peak  # the state: 96 MiB


def test_leaves_on_cpu_devices_never_lend_their_buffers(tmp_path):
    """On the CPU backend a box's buffer may become the device array itself: the plan of a
    leaf on CPU devices does not recycle, and a restore there lends nothing, even with a
    plan that says its leaf is bound for another device."""
    tree = {"w": np.arange(MiB, dtype=np.float32)}
    objckpt.save(tmp_path.as_uri(), tree)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = {"w": jax.ShapeDtypeStruct((MiB,), np.float32, sharding=one)}
    (entry,) = full_manifest(from_url(tmp_path.as_uri())).leaves
    assert not plan_leaf(entry, target["w"]).recycles_buffers
    made: list[Landing] = []

    def landing(plans, **kwargs):
        made.append(Landing(plans, **kwargs))
        return made[-1]

    out = restore_with(
        from_url(tmp_path.as_uri()),
        paths(target),
        landing=landing,
        whole_leaf_bytes=0,
        replan=lambda plan: dataclasses.replace(plan, on_host=False),
    )
    np.testing.assert_array_equal(np.asarray(out["['w']"]), tree["w"])
    assert made[-1].recycled.made == 0
