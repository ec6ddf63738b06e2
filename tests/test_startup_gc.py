"""``runtime.startup_gc``: start-up runs with the cyclic GC held, then freezes its heap."""

from __future__ import annotations

import gc

import pytest

from laminar_core.runtime.startup_gc import hold_gc, release_gc, startup_gc


@pytest.fixture(autouse=True)
def _gc_on():
    gc.enable()
    yield
    gc.enable()


def test_collection_is_held_for_the_block_and_back_on_after_it():
    frozen = gc.get_freeze_count()
    keep = [[i] for i in range(1000)]  # alive across the block: frozen at its end
    with startup_gc():
        assert not gc.isenabled()
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(keep)


def test_collection_is_back_on_when_start_up_fails():
    with pytest.raises(RuntimeError, match="engine failed"), startup_gc():
        raise RuntimeError("engine failed")
    assert gc.isenabled()


def test_release_restores_the_state_hold_found():
    gc.disable()
    was_on = hold_gc()
    release_gc(was_on)
    assert not was_on and not gc.isenabled()  # a caller that had it off keeps it off
