"""A message the agent sends just as its stream to the controller ends goes on the next
stream: gRPC pulls a stream's messages on a thread of its own, which may be waiting on
the agent's outbox when the stream ends (agent/link.ControllerLink._take)."""

import queue
import threading
from types import SimpleNamespace

from agent.link import ControllerLink
from protos import keel_pb2


class WatchedQueue(queue.Queue):
    """A queue that says when someone waits on it."""

    def __init__(self):
        super().__init__()
        self.waiting = threading.Event()

    def get(self, *args, **kwargs):
        self.waiting.set()
        return super().get(*args, **kwargs)


def test_a_message_taken_for_a_stream_that_ended_is_sent_on_the_next():
    hello = keel_pb2.AgentMessage(hello=keel_pb2.Hello(node="n"))
    ready = keel_pb2.AgentMessage(rendezvous_ready=keel_pb2.RendezvousReady(port=29500))
    link = ControllerLink(
        SimpleNamespace(),
        "token",
        None,
        None,
        5.0,
        opening=lambda: [hello],
        deliver=lambda message: None,
        stopping=threading.Event(),
    )
    link.outbox = WatchedQueue()
    ended = threading.Event()
    old = link._requests(ended)
    assert next(old) == hello
    sent_on_old = []
    puller = threading.Thread(target=lambda: sent_on_old.extend(old))
    puller.start()
    assert link.outbox.waiting.wait(10)  # the old stream's puller waits on the outbox
    ended.set()  # the stream ends ...
    link.outbox.put(ready)  # ... and the answer is sent just then
    puller.join(10)
    assert not puller.is_alive() and sent_on_old == []
    new = link._requests(threading.Event())
    link.outbox.put(None)  # the agent stops after it
    assert list(new) == [hello, ready]


def test_messages_keep_their_order_on_one_stream_and_none_ends_it():
    link = ControllerLink(
        SimpleNamespace(),
        "token",
        None,
        None,
        5.0,
        opening=lambda: [],
        deliver=lambda message: None,
        stopping=threading.Event(),
    )
    messages = [keel_pb2.AgentMessage(leaving=keel_pb2.Leaving(reason=str(i))) for i in range(5)]
    for message in messages:
        link.outbox.put(message)
    link.outbox.put(None)
    assert list(link._requests(threading.Event())) == messages
