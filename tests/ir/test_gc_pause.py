"""metaopt.ir.gc_pause: the collector is paused inside, and left as it was found."""

from __future__ import annotations

import gc

import pytest

from metaopt.ir.gc_pause import gc_paused, without_gc


@pytest.fixture(autouse=True)
def _restore_gc():
    was = gc.isenabled()
    yield
    (gc.enable if was else gc.disable)()


def test_paused_inside_enabled_after():
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():  # nested: still paused, and the inner exit does not enable
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_disabled_collector_stays_disabled():
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_enabled_again_after_an_error_and_the_result_passes_through():
    gc.enable()

    @without_gc
    def fails():
        assert not gc.isenabled()
        raise KeyError("x")

    with pytest.raises(KeyError):
        fails()
    assert gc.isenabled()
    assert without_gc(lambda a, b=2: a + b)(1, b=3) == 4


def test_a_bulk_build_is_collected_on_leaving():
    gc.enable()
    gc.collect()
    with gc_paused():
        made = [[i] for i in range(60_000)]  # over the bulk threshold: collected young on exit
    assert gc.get_count()[0] < 1000
    del made
