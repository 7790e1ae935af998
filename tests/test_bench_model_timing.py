"""bench/model_timing.py: the CUPTI summary's busy time, span and idle gaps inside a call."""

from __future__ import annotations

import pytest

from bench.model_timing import summarise_kernels


def _calls(offsets, gap_before_c: float):
    """Per call: a 10 us, b 5 us right after it, c 20 us after `gap_before_c` us of idle."""
    evs = []
    for t in offsets:
        evs += [("a", t, t + 10), ("b", t + 10, t + 15), ("c", t + 15 + gap_before_c, t + 35 + gap_before_c)]
    return evs


def test_idle_inside_a_call_is_named_by_the_kernels_either_side():
    s = summarise_kernels(_calls([0, 1000, 2500], 4.0), calls=3)
    assert s["busy_us"] == pytest.approx(35.0)
    assert s["span_us"] == pytest.approx(39.0)  # the host's pauses between calls are not in it
    assert s["idle_in_call_us"] == pytest.approx(4.0)
    assert s["gaps"] == [{"after": "b", "before": "c", "us": 4.0}]
    assert [t["name"] for t in s["top"]] == ["c", "a", "b"]


def test_back_to_back_calls_are_one_run_shared_out():
    s = summarise_kernels(_calls([0, 50], 0.0), calls=2, synced=False)
    assert s["span_us"] == pytest.approx(42.5)  # 85 us for two calls
    assert s["gaps"] == [{"after": "c", "before": "a", "us": 7.5}]


def test_an_overlapping_kernel_does_not_count_as_a_gap():
    evs = [("a", 0, 30), ("b", 5, 10), ("c", 30, 40)]  # b runs inside a's time (another stream)
    s = summarise_kernels(evs, calls=1)
    assert s["gaps"] == [] and s["idle_in_call_us"] == 0.0


def test_calls_of_equal_length_are_cut_by_count_not_by_their_longest_pauses():
    """A call whose host pauses 40 us before its second launch (kernels launched outside a CUDA graph): the
    pause is idle inside the call, not a cut between calls."""
    evs = []
    for t in (0, 100, 200):
        evs += [("mask", t, t + 2), ("embed", t + 42, t + 44), ("graph", t + 44, t + 90)]
    s = summarise_kernels(evs, calls=3)
    assert s["span_us"] == pytest.approx(90.0) and s["idle_in_call_us"] == pytest.approx(40.0)
    assert s["gaps"] == [{"after": "mask", "before": "embed", "us": 40.0}]


def test_a_dependent_kernels_wait_is_not_its_exposed_time():
    """Programmatic dependent launch: b starts 25 us into a's 30 and waits, c the same into b: their durations add
    up to more than the span, their exposed times (each past the kernels before it) to the span."""
    evs = []
    for t in (0, 100):
        evs += [("a", t, t + 30), ("b", t + 25, t + 40), ("c", t + 38, t + 45)]
    s = summarise_kernels(evs, calls=2)
    assert s["busy_us"] == pytest.approx(52.0) and s["span_us"] == pytest.approx(45.0)
    assert s["exposed_us"] == pytest.approx(45.0)
    assert {t["name"]: t["exposed_us"] for t in s["top"]} == {"a": 30.0, "b": 10.0, "c": 5.0}
    assert {t["name"]: t["us"] for t in s["top"]} == {"a": 30.0, "b": 15.0, "c": 7.0}


def test_the_timeline_is_the_second_calls_launches_with_their_exposed_and_idle_time():
    evs = []
    for t in (0, 100, 200):
        evs += [("a", t, t + 30), ("b", t + 25, t + 40), ("c", t + 44, t + 50)]
    s = summarise_kernels(evs, calls=3, timeline=True)
    assert s["timeline"] == [["a", 0.0, 30.0, 30.0, 0.0], ["b", 25.0, 15.0, 10.0, 0.0], ["c", 44.0, 6.0, 6.0, 4.0]]
    assert "timeline" not in summarise_kernels(evs, calls=3)


def test_idle_time_counts_the_gaps_between_kernels_even_where_others_overlap():
    """Dependent launch: b overlaps a (busy 45 us exceeds the 43 us span), and c starts 3 us after b ends: the call
    was idle 3 us, not max(span - busy, 0) = 0."""
    evs = [("a", 0, 30), ("b", 20, 35), ("c", 38, 43)]
    s = summarise_kernels(evs, calls=1)
    assert s["busy_us"] == pytest.approx(50.0) and s["span_us"] == pytest.approx(43.0)
    assert s["idle_in_call_us"] == pytest.approx(3.0) and s["exposed_us"] == pytest.approx(40.0)


def test_a_marker_drops_the_partial_call_the_recording_started_in_and_counts_the_calls():
    """Recording from inside a call (decode steps queued ahead): the kernels up to the first `greedy` end are
    dropped, the calls are the `greedy` launches after it, and the timeline is the first whole call."""
    evs = [("b", 0, 5), ("greedy", 5, 6)]  # the end of a step begun before the recording
    for t in (10, 20):
        evs += [("a", t, t + 4), ("b", t + 4, t + 8), ("greedy", t + 8, t + 9)]
    s = summarise_kernels(evs, calls=99, synced=False, timeline=True, marker="greedy")
    assert s["kernels_per_call"] == 3.0 and s["busy_us"] == pytest.approx(9.0)
    assert s["span_us"] == pytest.approx(9.5)  # 10 .. 29 over two steps
    assert [row[0] for row in s["timeline"]] == ["a", "b", "greedy"]
