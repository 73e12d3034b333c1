"""spice_megatron/torchrun.py: ports handed out before their user binds them."""
import socket

from spice_megatron.torchrun import free_port


def test_a_handed_out_port_is_not_given_to_another_bind_until_its_server_takes_it():
    """EADDRINUSE under xdist: another process's bind(0) used to get a port free_port() had just
    handed out (38 of 50 ports were given again within 20,000 binds before the TIME_WAIT reserve)."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    given = set()
    for _ in range(20000):  # what other processes' bind(0) calls get meanwhile
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            given.add(s.getsockname()[1])
    assert not set(ports) & given
    with socket.socket() as server:  # the server it was meant for binds it at once (SO_REUSEADDR)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", ports[0]))
        server.listen(1)
