"""The gateway's accepted connections send each SSE event at once (TCP_NODELAY).

A listener made with proto 0 (as the gateway's own `_listen`, and most servers, make it) gives
accepted sockets that asyncio's loop leaves with Nagle on; the gateway sets TCP_NODELAY itself."""

from __future__ import annotations

import socket

from tito_gateway.server import _listen, set_no_delay


class FakeTransport:
    def __init__(self, sock):
        self.sock = sock

    def get_extra_info(self, name):
        return self.sock if name == "socket" else None


def accepted_pair():
    listener, address = _listen("127.0.0.1:0")
    listener.setblocking(True)
    client = socket.create_connection(("127.0.0.1", int(address.rsplit(":", 1)[1])))
    accepted, _ = listener.accept()
    return listener, client, accepted


def test_an_accepted_tcp_connection_gets_no_delay():
    listener, client, accepted = accepted_pair()
    with listener, client, accepted:
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 0  # what the loop would leave
        set_no_delay(FakeTransport(accepted))
        assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1


def test_unix_sockets_and_transports_without_a_socket_are_left_alone(tmp_path):
    listener, _ = _listen(f"unix:{tmp_path / 'gateway.sock'}")
    with listener:
        set_no_delay(FakeTransport(listener))  # AF_UNIX has no TCP options: nothing to set, no error
    set_no_delay(FakeTransport(None))
