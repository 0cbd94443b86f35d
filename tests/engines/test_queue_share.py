"""`QueueShare`: a full queue's largest requests yield to smaller ones, never to larger or equal ones."""

from __future__ import annotations

from relax_gym.engines.queue_share import QueueShare


def test_requests_are_admitted_while_there_is_room():
    queue = QueueShare(4)
    holds = [queue.take(1), queue.take(3)]
    assert all(holds) and queue.held == 4
    queue.give_back(holds[0])
    assert queue.held == 3


def test_a_small_request_displaces_the_newest_of_the_largest():
    queue = QueueShare(256)
    big = [queue.take(64) for _ in range(4)]  # the review's attack: four chats with n=64
    assert queue.held == 256
    small = queue.take(1)
    assert small is not None
    assert [hold.displaced.is_set() for hold in big] == [False, False, False, True]
    assert queue.held == 193
    queue.give_back(big[3])  # the displaced request's handler gives back what is already free
    assert queue.held == 193


def test_a_request_never_displaces_one_as_small_as_itself():
    queue = QueueShare(3)
    held = [queue.take(1) for _ in range(3)]
    assert queue.take(1) is None and queue.take(2) is None
    assert not any(hold.displaced.is_set() for hold in held)


def test_nothing_is_displaced_when_the_larger_requests_would_not_make_room():
    queue = QueueShare(10)
    four, ones = queue.take(4), [queue.take(1) for _ in range(6)]
    assert queue.take(5) is None  # nothing held is larger than 5
    assert queue.take(3) is not None  # the 4 yields to the 3
    assert four.displaced.is_set() and not any(hold.displaced.is_set() for hold in ones)


def test_several_larger_requests_yield_when_one_is_not_enough():
    queue = QueueShare(8)
    threes = [queue.take(3), queue.take(3)]
    two = queue.take(2)
    assert queue.held == 8
    assert queue.take(2) is not None  # one 3 frees room for the 2
    assert sum(hold.displaced.is_set() for hold in threes) == 1 and not two.displaced.is_set()
    assert queue.take(1) is not None  # room left after the 3 went: nothing displaced
    assert queue.take(2) is not None  # the other 3 yields
    assert all(hold.displaced.is_set() for hold in threes) and queue.held == 7
