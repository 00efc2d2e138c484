"""The job server's queue (runtime.server.FifoLock): jobs start in the order they arrived."""

from __future__ import annotations

import random
import threading
import time

from cdc_lakehouse.runtime.server import FifoLock


def wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while not cond():
        assert time.time() < deadline, "timed out"
        time.sleep(0.001)


def test_queued_jobs_start_in_arrival_order():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    rnd = random.Random(seed)
    lock, started = FifoLock(), []

    def job(n: int) -> None:
        with lock:
            started.append(n)
            time.sleep(rnd.random() / 1000)  # each holds the lock a little while

    with lock:  # a running job; the others queue behind it, one after another
        threads = []
        for n in range(12):
            t = threading.Thread(target=job, args=(n,))
            t.start()
            threads.append(t)
            wait_until(lambda n=n: lock.waiting == n + 2)  # the holder plus n + 1 queued
    for t in threads:
        t.join(timeout=10)
    assert started == list(range(12)), f"seed {seed}"
    assert lock.waiting == 0


def test_the_releasing_thread_asking_again_queues_behind_the_waiter():
    """Where threading.Lock fails (20 of 20 runs with it in FifoLock's place): its releasing thread
    takes it straight back before the waiter wakes. FifoLock hands it to the oldest waiter."""
    lock, order = FifoLock(), []
    release = threading.Event()

    def first() -> None:
        with lock:
            release.wait(10)
        with lock:  # straight back in the queue: behind the waiter, not before it
            order.append("first again")

    def second() -> None:
        with lock:
            order.append("second")

    a = threading.Thread(target=first)
    a.start()
    wait_until(lambda: lock.waiting == 1)
    b = threading.Thread(target=second)
    b.start()
    wait_until(lambda: lock.waiting == 2)
    release.set()
    a.join(10)
    b.join(10)
    assert order == ["second", "first again"]


def test_a_waiter_interrupted_in_the_queue_does_not_stall_the_ones_behind_it():
    lock, order = FifoLock(), []
    real_wait = lock._cond.wait_for

    def wait_for(predicate):  # the interrupted thread's wait raises, as a KeyboardInterrupt would
        if threading.current_thread().name == "interrupted":
            raise KeyboardInterrupt
        return real_wait(predicate)

    lock._cond.wait_for = wait_for

    def interrupted() -> None:
        try:
            with lock:
                order.append("interrupted")  # never: it left the queue
        except KeyboardInterrupt:
            order.append("left")

    def behind() -> None:
        with lock:
            order.append("behind")

    with lock:
        a = threading.Thread(target=interrupted, name="interrupted")
        a.start()
        a.join(10)
        b = threading.Thread(target=behind)
        b.start()
        wait_until(lambda: lock.waiting == 2)  # the holder and the one behind; not the one that left
    b.join(10)
    assert order == ["left", "behind"]
    assert lock.waiting == 0
