"""hack/nettrace.py's reading of strace output: what counts as local, what fails the loopback tests."""

from __future__ import annotations

import ipaddress

from nettrace import parse

EXEC = '100<python> execve("/usr/bin/python", ["python", "-m", "kora_trainer.train"], 0x7ffd /* 30 vars */) = 0'
CLONE = "100<python> clone3({flags=CLONE_VM, ...}, 88) = 101"


def inet(pid: int, addr: str, port: int, fd: int = 3) -> str:
    return (f'{pid}<raylet> connect({fd}, {{sa_family=AF_INET, sin_port=htons({port}), '
            f'sin_addr=inet_addr("{addr}")}}, 16) = -1 EINPROGRESS (Operation now in progress)')


def test_loopback_unix_and_netlink_are_local():
    lines = [EXEC, inet(100, "127.0.0.1", 6379),
             '100<python> connect(4, {sa_family=AF_UNIX, sun_path="/tmp/ray/session/sockets/raylet"}, 110) = 0',
             '100<python> sendto(5, [{nlmsg_len=20}], 20, 0, {sa_family=AF_NETLINK, nl_pid=0, nl_groups=0}, 12) = 20',
             '100<python> connect(6, {sa_family=AF_INET6, sin6_port=htons(80), sin6_flowinfo=htonl(0), '
             'inet_pton(AF_INET6, "::ffff:127.0.0.1", &sin6_addr), sin6_scope_id=0}, 28) = 0']
    trace = parse("\n".join(lines), [])
    assert trace.foreign == []
    assert trace.counts == {"loopback": 2, "unix": 1, "netlink": 1}


def test_a_foreign_address_is_reported_with_its_process():
    trace = parse("\n".join([EXEC, CLONE, inet(101, "192.0.2.2", 44629),
                             inet(101, "169.254.169.254", 80, fd=7)]), [])
    assert [(pid, dest) for pid, _, dest in trace.foreign] == [(101, "192.0.2.2:44629"), (101, "169.254.169.254:80")]
    assert "kora_trainer.train" in trace.foreign[0][1]  # the thread is named after the process that made it
    assert "FOREIGN 169.254.169.254:80" in trace.report()


def test_allowed_networks_count_apart():
    trace = parse(inet(100, "10.77.0.2", 6379), [ipaddress.ip_network("10.77.0.0/24")])
    assert trace.foreign == [] and trace.counts == {"allowed": 1}


def test_an_ipv4_mapped_address_is_judged_as_its_ipv4_address():
    """Ray's sockets are dual-stack: on the real node its head pod reached its own IP as ::ffff:10.213.0.5, which
    counted foreign against the allowed 10.213.0.0/16 (issue 41)."""
    mapped = ('100<raylet> connect(6, {sa_family=AF_INET6, sin6_port=htons(6379), sin6_flowinfo=htonl(0), '
              'inet_pton(AF_INET6, "::ffff:{ip}", &sin6_addr), sin6_scope_id=0}, 28) = 0')
    allow = [ipaddress.ip_network("10.213.0.0/16")]
    assert parse(mapped.replace("{ip}", "10.213.0.5"), allow).counts == {"allowed": 1}
    assert parse(mapped.replace("{ip}", "192.0.2.2"), allow).foreign[0][2] == "::ffff:192.0.2.2:6379"


def test_a_udp_socket_connected_to_port_53_that_sends_nothing_is_a_route_probe():
    """Ray's node-IP discovery: a UDP connect() to 8.8.8.8:53 and getsockname, no datagram (the real node's head pod,
    issue 41). The same socket sending a query, or a socket of unknown type, is still foreign."""
    made = "300<ray> socket(AF_INET, SOCK_DGRAM|SOCK_CLOEXEC, IPPROTO_IP) = 7<socket:[555]>"
    conn = ('300<ray> connect(7<socket:[555]>, {sa_family=AF_INET, sin_port=htons(53), '
            'sin_addr=inet_addr("8.8.8.8")}, 16) = 0')
    probe = parse("\n".join([made, conn]), [])
    assert probe.foreign == [] and probe.counts == {"udp-route-probe": 1}
    sent = parse("\n".join([made, conn, '300<ray> sendto(7<socket:[555]>, "\\1\\2", 2, 0, NULL, 0) = 2']), [])
    assert [d for _, _, d in sent.foreign] == ["8.8.8.8:53 (DNS: (not a DNS query))"]
    unknown = parse(conn, [])  # its socket() not seen: not assumed UDP
    assert len(unknown.foreign) == 1 and "no query seen" in unknown.foreign[0][2]
    tcp = "300<ray> socket(AF_INET, SOCK_STREAM|SOCK_CLOEXEC, IPPROTO_IP) = 7<socket:[555]>"
    assert len(parse("\n".join([tcp, conn]), []).foreign) == 1


def test_dns_is_foreign_unless_every_query_is_a_loopback_reverse_lookup():
    # as strace prints them: the PTR query for 1.0.0.127.in-addr.arpa, and an A query for metadata.google.internal
    ptr = ('200<python> sendto(9, "\\246\\203\\1\\0\\0\\1\\0\\0\\0\\0\\0\\0\\0011\\0010\\0010\\003127'
           '\\7in-addr\\4arpa\\0\\0\\f\\0\\1", 40, MSG_NOSIGNAL, NULL, 0) = 40')
    query = ('201<python> sendto(9, "\\221+\\1\\0\\0\\1\\0\\0\\0\\0\\0\\0\\10metadata\\6google\\10internal'
             '\\0\\0\\1\\0\\1", 46, MSG_NOSIGNAL, NULL, 0) = 46')
    local = parse("\n".join([inet(200, "10.255.255.53", 53, fd=9), ptr]), [])
    assert local.foreign == [] and local.counts == {"loopback-ptr": 1}
    remote = parse("\n".join([inet(201, "10.255.255.53", 53, fd=9), query]), [])
    assert [dest for _, _, dest in remote.foreign] == ["10.255.255.53:53 (DNS: metadata.google.internal.)"]
    silent = parse(inet(202, "10.255.255.53", 53, fd=9), [])  # a resolver socket with no query seen
    assert len(silent.foreign) == 1


def test_an_unknown_family_is_not_assumed_local():
    trace = parse('100<python> connect(3, {sa_family=AF_PACKET, sll_protocol=htons(ETH_P_ALL)}, 20) = 0', [])
    assert len(trace.foreign) == 1


def test_a_resolver_sockets_number_reused_by_the_next_socket_is_not_dns():
    """The number of a closed resolver socket comes back for the process's next socket; its sends are not
    questions. strace -y names each socket by inode, and the parser follows the inode."""
    ptr = ('300<python> sendto(55<socket:[901]>, "\\337x\\1\\0\\0\\1\\0\\0\\0\\0\\0\\0\\0011\\0010\\0010\\003127'
           '\\7in-addr\\4arpa\\0\\0\\f\\0\\1", 40, MSG_NOSIGNAL, NULL, 0) = 40')
    lines = ['300<python> connect(55<socket:[901]>, {sa_family=AF_INET, sin_port=htons(53), '
             'sin_addr=inet_addr("10.255.255.53")}, 16) = 0', ptr,
             '300<python> connect(55<socket:[902]>, {sa_family=AF_INET, sin_port=htons(41000), '
             'sin_addr=inet_addr("127.0.0.1")}, 16) = 0',
             '300<python> sendto(55<socket:[902]>, "\\0\\316\\367\\205<", 5, MSG_NOSIGNAL, NULL, 0) = 5']
    trace = parse("\n".join(lines), [])
    assert trace.foreign == [] and trace.counts == {"loopback": 1, "loopback-ptr": 1}


def test_a_foreign_dns_socket_is_reported_with_the_names_it_asked():
    query = ('201<python> sendto(9<socket:[77]>, "\\221+\\1\\0\\0\\1\\0\\0\\0\\0\\0\\0\\10metadata\\6google'
             '\\10internal\\0\\0\\1\\0\\1", 46, MSG_NOSIGNAL, NULL, 0) = 46')
    trace = parse("\n".join([inet(201, "10.255.255.53", 53, fd=9).replace("(9,", "(9<socket:[77]>,"), query]), [])
    assert [dest for _, _, dest in trace.foreign] == ["10.255.255.53:53 (DNS: metadata.google.internal.)"]
    assert trace.foreign[0][0] == 201
