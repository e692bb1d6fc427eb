"""Events posted from another thread reach the loop in order, with one wake-up per burst."""

import asyncio
import threading
import time

from neuron_serve.generation.frontend.mailbox import Mailbox


class Counted(Mailbox):
    flushes = 0

    def _flush(self) -> None:
        self.flushes += 1
        super()._flush()


def test_a_burst_posted_while_the_loop_is_busy_is_delivered_in_order_in_one_wake_up():
    async def main():
        loop = asyncio.get_running_loop()
        mailbox = Counted(loop)
        got: list[int] = []
        posted = threading.Event()

        def engine():
            for i in range(100):
                mailbox.post(got.append, i)
            posted.set()

        thread = threading.Thread(target=engine)
        thread.start()
        posted.wait()  # the loop is blocked here, as it is while it encodes a chunk
        thread.join()
        while len(got) < 100:
            await asyncio.sleep(0.001)
        mailbox.post(got.append, 100)  # a later post wakes the loop again
        deadline = time.monotonic() + 5
        while len(got) < 101 and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        return got, mailbox.flushes

    got, flushes = asyncio.run(main())
    assert got == list(range(101))
    assert flushes == 2


def test_posting_to_a_closed_loop_is_dropped():
    loop = asyncio.new_event_loop()
    loop.close()
    Mailbox(loop).post(print, "nobody reads this")  # no error: the stream was left
