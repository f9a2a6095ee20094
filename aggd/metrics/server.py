"""The metrics endpoint: ``[metrics] address`` (inside ``dataplane.netns`` when that is set, like
the daemon's other sockets) serving the aggd collector and client_python's process collector."""
from __future__ import annotations

import logging

from aggd.core.addresses import host_port
from aggd.metrics.collector import DEFAULT_MAX_JOBS, DEFAULT_MAX_RANKS, AggdCollector
from aggd.metrics.reader import Reader, ServiceReader

log = logging.getLogger(__name__)


#: How often the server's loop looks for a stop (client_python's own loop looks every 0.5 s, which
#: was most of a daemon's stop: SIGTERM to exit in 0.77 s, now about 0.3).
STOP_POLL = 0.05


class MetricsServer:
    def __init__(self, httpd, thread, address: tuple[str, int]):
        self.httpd, self.thread, self.address = httpd, thread, address

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def start_server(host: str, port: int, registry):
    """client_python's WSGI app on a threading server of our own, whose loop stops within STOP_POLL.
    Returns (server, thread)."""
    import socket
    import threading
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    from prometheus_client import make_wsgi_app

    family, *_, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]

    class Server(ThreadingMixIn, WSGIServer):
        address_family = family
        daemon_threads = True

    class QuietHandler(WSGIRequestHandler):
        def log_message(self, *args) -> None:   # scrapes are not news
            pass

    httpd = make_server(sockaddr[0], port, make_wsgi_app(registry), Server, handler_class=QuietHandler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": STOP_POLL},
                              name="aggd-metrics", daemon=True)
    thread.start()
    return httpd, thread


def registry_for(reader: Reader, **limits):
    """A CollectorRegistry with the aggd collector (and the process collector)."""
    from prometheus_client import CollectorRegistry, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    ProcessCollector(registry=registry)
    registry.register(AggdCollector(reader, **limits))
    return registry


def serve(service) -> MetricsServer:
    """Start the endpoint of a started ``Service`` on ``[metrics] address``, in
    ``dataplane.netns`` if set. The limits are read from the service's config at each scrape, so a
    reload applies them."""
    from contextlib import nullcontext

    cfg = service.config
    host, port = host_port(cfg.metrics.address)
    registry = registry_for(ServiceReader(service),
                            max_jobs=lambda: getattr(service.config.metrics, "max_jobs", DEFAULT_MAX_JOBS),
                            max_ranks=lambda: getattr(service.config.metrics, "max_ranks", DEFAULT_MAX_RANKS))
    netns = cfg.dataplane.netns or None
    if netns:
        from aggd.dataplane.netns import in_netns
        where = in_netns(netns)
    else:
        where = nullcontext()
    try:
        with where:  # the listening socket stays in the namespace it was made in
            httpd, thread = start_server(host, port, registry)
    except OSError as exc:
        raise OSError(exc.errno, f"metrics.address {cfg.metrics.address}"
                                 f"{' in netns ' + netns if netns else ''}: {exc.strerror}") from None
    log.info("metrics on http://%s:%d/metrics%s", host, port, f" in netns {netns}" if netns else "")
    return MetricsServer(httpd, thread, (host, port))
