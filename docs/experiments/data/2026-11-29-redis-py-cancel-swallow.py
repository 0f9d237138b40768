"""How often redis-py's asyncio client swallows a task's cancellation (2026-11-29).

Standalone: needs only `redis` (redis-py) in the running interpreter and `redis-server` on PATH. It
starts its own redis-server on a free loopback port (--save '', no AOF) and stops it at the end.

The client is built as the services build theirs (specmesh/cluster/redis_clients.py, and the
services' from_url calls on 2026-11-27): socket_timeout=5 s, socket_connect_timeout=2 s;
--socket-timeout 0 builds it with socket_timeout=None instead (no timeout on commands).

Per try (a fresh client, connected before the task starts):
- "swallowed": a task loops `await r.xrange(key, count=10)`; it is cancelled once after a random
  0-5 ms. The call is swallowed when it returns normally although the task was asked to cancel
  (`asyncio.current_task().cancelling()` still set after it returned); the task then stops. Otherwise
  the task ends with CancelledError (counted "raised") or another exception (counted "errors").
- "still running": the same loop without the check, cancelled once after a random 0-5 ms; counted when
  the task has not finished 20 ms after the cancel (then it is cancelled until it ends).
The control does the same with plain asyncio streams: `PING\\r\\n` then `reader.readline()`.

Delays come from random.Random(seed) (one generator per client and measure), so every run tries the
same delays; the outcomes still depend on timing.

Rows are merged into --out by (client, Python, socket_timeout): a run under another redis-py, Python
or timeout adds its rows, a run with the same ones replaces them:
    python3 -m venv /tmp/rp810 && /tmp/rp810/bin/pip install redis==8.1.0
    /tmp/rp810/bin/python docs/experiments/data/2026-11-29-redis-py-cancel-swallow.py \
        --out docs/experiments/data/2026-11-29-redis-py-cancel-swallow.json
"""

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

STREAM = "cancel-swallow:stream"
ENTRIES = 10
STILL_RUNNING_AFTER_S = 0.020


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_redis(port: int) -> subprocess.Popen:
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--protected-mode", "yes"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return process
        except OSError:
            time.sleep(0.05)
    process.kill()
    raise RuntimeError("redis-server did not start")


def git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


# ---- redis-py ---------------------------------------------------------------------------------------

def redis_py_client(port: int, socket_timeout):
    import redis.asyncio as aioredis

    return aioredis.Redis(host="127.0.0.1", port=port, socket_timeout=socket_timeout, socket_connect_timeout=2.0)


async def redis_py_swallowed(port: int, delays: list[float], socket_timeout) -> dict:
    counts = {"swallowed": 0, "raised": 0, "errors": 0, "calls_returned": 0}
    for delay in delays:
        r = redis_py_client(port, socket_timeout)
        await r.ping()  # connected before the task starts
        calls = 0

        async def loop():
            nonlocal calls
            me = asyncio.current_task()
            while True:
                await r.xrange(STREAM, count=ENTRIES)
                calls += 1
                if me.cancelling():
                    return "swallowed"

        task = asyncio.create_task(loop())
        await asyncio.sleep(delay)
        task.cancel()
        try:
            counts[await task] += 1
        except asyncio.CancelledError:
            counts["raised"] += 1
        except Exception:
            counts["errors"] += 1
        counts["calls_returned"] += calls
        await close_redis_py(r)
    return counts


async def redis_py_still_running(port: int, delays: list[float], socket_timeout) -> dict:
    counts = {"still_running": 0, "ended": 0, "cancels_to_end_max": 0}
    for delay in delays:
        r = redis_py_client(port, socket_timeout)
        await r.ping()

        async def loop():
            while True:
                await r.xrange(STREAM, count=ENTRIES)

        task = asyncio.create_task(loop())
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.wait([task], timeout=STILL_RUNNING_AFTER_S)
        counts["still_running" if not task.done() else "ended"] += 1
        cancels = 1
        while not task.done():
            task.cancel()
            cancels += 1
            await asyncio.wait([task], timeout=0.005)
        counts["cancels_to_end_max"] = max(counts["cancels_to_end_max"], cancels)
        try:
            await task
        except BaseException:
            pass
        await close_redis_py(r)
    return counts


async def close_redis_py(r) -> None:
    close = getattr(r, "aclose", None) or r.close
    try:
        await close()
    except Exception:
        pass


# ---- plain asyncio streams (control) -----------------------------------------------------------------

async def streams_loop(reader, writer, check: bool):
    me = asyncio.current_task()
    while True:
        writer.write(b"PING\r\n")
        await writer.drain()
        line = await reader.readline()
        assert line == b"+PONG\r\n", line
        if check and me.cancelling():
            return "swallowed"


async def streams_swallowed(port: int, delays: list[float]) -> dict:
    counts = {"swallowed": 0, "raised": 0, "errors": 0}
    for delay in delays:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        task = asyncio.create_task(streams_loop(reader, writer, check=True))
        await asyncio.sleep(delay)
        task.cancel()
        try:
            counts[await task] += 1
        except asyncio.CancelledError:
            counts["raised"] += 1
        except Exception:
            counts["errors"] += 1
        writer.close()
        await writer.wait_closed()
    return counts


async def streams_still_running(port: int, delays: list[float]) -> dict:
    counts = {"still_running": 0, "ended": 0}
    for delay in delays:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        task = asyncio.create_task(streams_loop(reader, writer, check=False))
        await asyncio.sleep(delay)
        task.cancel()
        await asyncio.wait([task], timeout=STILL_RUNNING_AFTER_S)
        counts["still_running" if not task.done() else "ended"] += 1
        while not task.done():
            task.cancel()
            await asyncio.wait([task], timeout=0.005)
        try:
            await task
        except BaseException:
            pass
        writer.close()
        await writer.wait_closed()
    return counts


# ---- main ---------------------------------------------------------------------------------------------

def delays_for(seed: int, name: str, tries: int, max_delay_s: float) -> list[float]:
    rng = random.Random(f"{seed}:{name}")
    return [rng.uniform(0.0, max_delay_s) for _ in range(tries)]


async def measure(port: int, tries: int, seed: int, max_delay_s: float, clients: list[str], socket_timeout) -> list[dict]:
    import redis.asyncio as aioredis

    setup = aioredis.Redis(host="127.0.0.1", port=port)
    await setup.delete(STREAM)
    for i in range(ENTRIES):
        await setup.xadd(STREAM, {"job": f"job-{i}".encode() * 8, "n": str(i)})
    await close_redis_py(setup)

    rows = []
    for client in clients:
        if client == "redis-py":
            import redis
            name = f"redis-py {redis.__version__}"
            call = f"await r.xrange(stream, count={ENTRIES})"
            timeout = redis_py_client(port, socket_timeout).connection_pool.connection_kwargs.get("socket_timeout")
            swallowed = await redis_py_swallowed(port, delays_for(seed, "swallowed", tries, max_delay_s), socket_timeout)
            running = await redis_py_still_running(port, delays_for(seed, "still-running", tries, max_delay_s),
                                                   socket_timeout)
        else:
            name = "plain asyncio streams, PING / readline"
            timeout = None
            call = "writer.write(b'PING\\r\\n'); await writer.drain(); await reader.readline()"
            swallowed = await streams_swallowed(port, delays_for(seed, "swallowed", tries, max_delay_s))
            running = await streams_still_running(port, delays_for(seed, "still-running", tries, max_delay_s))
        rows.append({"client": name, "python": sys.version.split()[0], "socket_timeout": timeout, "call": call,
                     "tries": tries, "swallowed": swallowed["swallowed"],
                     "swallowed_detail": swallowed, "cancelled_once_still_running_after_20ms": running["still_running"],
                     "still_running_detail": running})
        print(f"{name} (Python {sys.version.split()[0]}, socket_timeout {timeout}): swallowed {swallowed['swallowed']} / {tries}; still running 20 ms after one cancel "
              f"{running['still_running']} / {tries}", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tries", type=int, default=200)
    parser.add_argument("--seed", type=int, default=20261129)
    parser.add_argument("--max-delay-ms", type=float, default=5.0)
    parser.add_argument("--socket-timeout", type=float, default=5.0, help="seconds; 0: None (no timeout)")
    parser.add_argument("--clients", default="redis-py,streams", help="comma-separated: redis-py, streams")
    parser.add_argument("--out", type=Path, help="JSON file; rows are merged into it by (client, Python, socket_timeout)")
    args = parser.parse_args()

    import redis

    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    run = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git("rev-parse", "HEAD"),
        "nproc": os.cpu_count(),
        "machine": platform.machine(),
        "kernel": platform.release(),
        "python": sys.version.split()[0],
        "redis_py": redis.__version__,
        "redis_server": subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip(),
        "socket_timeout_arg": args.socket_timeout or None,
        "tries": args.tries, "seed": args.seed, "max_delay_ms": args.max_delay_ms, "clients": clients,
        "loadavg_start": loadavg(),
    }
    port = free_port()
    server = start_redis(port)
    try:
        rows = asyncio.run(measure(port, args.tries, args.seed, args.max_delay_ms / 1000, clients,
                                   args.socket_timeout or None))
    finally:
        server.terminate()
        server.wait(timeout=10)
    run["loadavg_end"] = loadavg()

    if not args.out:
        return
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault("method", __doc__)
    data.setdefault("runs", [])
    for row in rows:
        row["run"] = len(data["runs"])  # index into "runs"
    data["runs"].append(run)
    key = lambda row: (row["client"], row["python"], row["socket_timeout"])  # noqa: E731
    data["rows"] = [r for r in data.get("rows", []) if key(r) not in {key(n) for n in rows}] + rows
    args.out.write_text(json.dumps(data, indent=2) + "\n")

if __name__ == "__main__":
    main()
