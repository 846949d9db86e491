"""``GET /metrics``: the server's counters as one flat JSON object.

``lost_outputs`` must stay 0: it counts output that reached neither an observation nor the
episode log. Output printed after its cell went idle is ``late_outputs`` (kept in the log, never
shown in the next step), and cut output is ``truncations``; neither is lost.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kernel_env.kernel.pool import KernelPool
from kernel_env.server.sessions import SessionManager

__all__ = ["collect", "process_rss"]


def collect(sessions: SessionManager, pool: KernelPool, started: float) -> dict[str, Any]:
    """A snapshot of every counter; ``started`` is the server's ``time.monotonic()`` at start."""
    live = sessions.sessions()
    in_sessions = sum(1 for s in live if s.holds_kernel)
    counters = sessions.counters()
    return {
        "sessions_active": len(live),
        "sessions_ws": sum(1 for s in live if s.kind == "ws"),
        "sessions_http": sum(1 for s in live if s.kind == "http"),
        "sessions_total": sessions.opened_total,
        "sessions_reaped": sessions.reaped_total,
        "max_sessions": sessions.max_sessions,
        "requests_in_flight": sum(s.busy for s in live),
        "streams_open": sum(s.streams for s in live),  # E2B's command streams, followed
        "kernels": pool.live,  # sessions', warm, starting and rlm_query children's
        "max_kernels": pool.max_kernels,
        "kernels_refused": pool.refused,
        "kernels_in_sessions": in_sessions,
        "pool_size": pool.size,
        "pool_warm": pool.warm,
        "pool_starting": pool.starting,
        "pool_acquired": pool.acquired,
        "pool_warm_hits": pool.warm_hits,
        "pool_start_failures": pool.start_failures,
        "steps": counters.steps,
        "timeouts": counters.timeouts,
        "restarts": counters.restarts,
        "truncations": counters.truncations,
        "late_outputs": counters.late_outputs,
        "lost_outputs": counters.lost_outputs,
        "oversize_messages": counters.oversize_messages,
        "uptime_s": round(time.monotonic() - started, 3),
        "rss_bytes": process_rss(),
    }


def process_rss(pid: int | str = "self") -> int | None:
    """Resident set size of a process in bytes (Linux ``/proc``); None where unavailable."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


# -- Prometheus' text format -----------------------------------------------------------------

PROMETHEUS_PREFIX = "kernel_env_"
# Counters only ever grow; every other number is a gauge (a level that goes up and down).
_COUNTERS = frozenset(
    {
        "sessions_total",
        "sessions_reaped",
        "kernels_refused",
        "pool_acquired",
        "pool_warm_hits",
        "pool_start_failures",
        "steps",
        "timeouts",
        "restarts",
        "truncations",
        "late_outputs",
        "lost_outputs",
        "oversize_messages",
    }
)
_HELP = {
    "uptime_s": "seconds since the server started",
    "rss_bytes": "the server process's resident memory",
    "streams_open": "command streams (E2B's) the server follows now",
    "lost_outputs": "output that reached neither an observation nor the episode log (stays 0)",
    "oversize_messages": "messages over the host's limit a kernel sent (each restarted it)",
}


def prometheus_text(snapshot: dict[str, Any]) -> tuple[bytes, str]:
    """``snapshot`` (from :func:`collect`) in Prometheus' text exposition format, rendered by
    prometheus_client; returns the body and its content type."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
    from prometheus_client.exposition import CONTENT_TYPE_LATEST

    class Snapshot:
        def collect(self) -> Any:
            for name, value in snapshot.items():
                if value is None or isinstance(value, bool):
                    continue
                full = PROMETHEUS_PREFIX + name
                doc = _HELP.get(name, name.replace("_", " "))
                family = CounterMetricFamily if name in _COUNTERS else GaugeMetricFamily
                yield family(full, doc, value=value)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry), CONTENT_TYPE_LATEST
