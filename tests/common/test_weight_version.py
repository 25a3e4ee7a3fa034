"""The weights-version rules every service reads (services/common/weight_version.py)."""

from services.common.weight_version import (
    AS_LOADED,
    after_update,
    first_of_run,
    moves_forward,
    outside_fence,
    serves,
)


def test_a_run_starts_past_every_version_anyone_held() -> None:
    assert first_of_run() == 1
    assert first_of_run(AS_LOADED, AS_LOADED) == 1
    assert first_of_run(7, 3, 9) == 10
    assert after_update(10) == 11


def test_versions_only_move_forward_and_the_same_version_may_come_again() -> None:
    assert moves_forward(5, 4) and moves_forward(5, 5)
    assert not moves_forward(4, 5)


def test_an_expected_version_of_zero_takes_any_replica() -> None:
    assert serves(AS_LOADED, 12) and serves(12, 12)
    assert not serves(11, 12)


def test_the_fence_names_versions_ahead_of_the_actor_or_too_far_behind() -> None:
    assert outside_fence([5, 5, 4], actor_version=5, max_staleness=1) == []
    assert outside_fence([5, 4, 3, 6, 3], actor_version=5, max_staleness=1) == [3, 6]
    assert outside_fence([4], actor_version=5, max_staleness=0) == [4]
    assert outside_fence([], actor_version=5, max_staleness=0) == []
