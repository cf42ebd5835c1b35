"""Reading HAProxy's `show stat` (benchmarks/haproxy_stats.py), on a real row layout."""

from __future__ import annotations

from benchmarks import haproxy_stats

HEADER = "# pxname,svname,qcur,scur,stot,chkfail,chkdown,status,bck,check_status,hanafail,\n"


def _row(sv: str, status: str, stot: int, chkdown: int = 0, hanafail: int = 0, bck: int = 0) -> str:
    return f"http-default,{sv},0,1,{stot},0,{chkdown},{status},{bck},L7OK,{hanafail},\n"


def test_server_rows_are_kept_and_the_summaries_dropped() -> None:
    text = HEADER + _row("r1", "UP", 5) + "http-default,BACKEND,0,0,9,,,UP,0,,,\n"
    assert [r["svname"] for r in haproxy_stats.parse_servers(text)] == ["r1"]


def test_summary_counts_down_samples_transitions_and_the_backups_requests() -> None:
    first = haproxy_stats.parse_servers(HEADER + _row("r1", "UP", 10) + _row("proxy", "UP", 0, bck=1))
    second = haproxy_stats.parse_servers(HEADER + _row("r1", "DOWN", 12, chkdown=1, hanafail=3) + _row("proxy", "UP", 40, bck=1))
    s = haproxy_stats.summary([first, second])
    assert s["http-default/r1"] == {"backup": False, "samples": 2, "not_up": 1, "chkdown": 1, "hanafail": 3,
                                    "requests": 12, "last_check": "L7OK"}  # fmt: skip
    assert s["http-default/proxy"]["requests"] == 40 and s["http-default/proxy"]["not_up"] == 0


def test_no_running_haproxy_gives_no_rows(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert haproxy_stats.servers(tmp_path) == []


# The start of HAProxy 2.8's `show info`, as Serve's HAProxy answered it.
INFO = """Name: HAProxy
Version: 2.8.25-5cf5d0683
Uptime_sec: 0
Memmax_MB: 0
PoolAlloc_MB: 0
PoolUsed_MB: 0
PoolFailed: 0
Maxconn: 7680
CurrConns: 12
PoolAlloc_bytes: 872352
PoolUsed_bytes: 610304
MaxconnReached: 0
"""


def test_show_info_gives_the_pools_bytes_and_the_connections_open() -> None:
    assert haproxy_stats.parse_info(INFO) == {"PoolAlloc_bytes": 872352, "PoolUsed_bytes": 610304, "CurrConns": 12}
    # A version without the byte counters gives what it has, not zeros.
    assert haproxy_stats.parse_info("CurrConns: 3\nPoolAlloc_MB: 1\n") == {"CurrConns": 3}


def test_no_running_haproxy_gives_no_info(tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert haproxy_stats.info(tmp_path) == {}
