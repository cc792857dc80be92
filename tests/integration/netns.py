"""Hosts for tests, made of Linux network namespaces (iproute2), and a delaying TCP relay.

`hosts(names)` builds one namespace per name, each with a veth link into one bridge in the
root namespace (10.R.0.i/24; the test process is 10.R.0.254 on the bridge), and tears it all
down on exit. The kernel here has no `netem` qdisc, so the delay of a link across regions is
made by `python -m tests.integration.netns relay LISTEN TARGET DELAY_MS`, run on the host
whose service it fronts: every chunk it reads is written on the other side `DELAY_MS` later,
in order, in both directions.

    with hosts(["broker", "worker"]) as net:
        proc = net.popen("worker", [sys.executable, "-m", "app.cli", ...], log=path)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path


def missing_privileges() -> str | None:
    """Why network namespaces cannot be built here (None: they can)."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "building network namespaces needs root"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Hosts:
    tag: str
    subnet: int  # the R of 10.R.0.0/24
    names: list[str]
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def namespace(self, name: str) -> str:
        return f"fw{self.tag}-{name}"

    def ip(self, name: str) -> str:
        return f"10.{self.subnet}.0.{self.names.index(name) + 1}"

    def popen(self, name: str, cmd: Sequence[str], *, log: Path,
              env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`cmd` on host `name` (`ip netns exec` execs it: the PID is the command's)."""
        with log.open("ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", self.namespace(name), *cmd],
                                    stdout=out, stderr=subprocess.STDOUT, env=env)
        self.processes.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in self.processes:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@contextlib.contextmanager
def hosts(names: Sequence[str]) -> Iterator[Hosts]:
    net = Hosts(tag=f"{random.randrange(16**4):04x}", subnet=random.randrange(100, 250),
                names=list(names))
    bridge = f"fwbr{net.tag}"
    made: list[str] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"10.{net.subnet}.0.254/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, name in enumerate(net.names):
            ns = net.namespace(name)
            _ip("netns", "add", ns)
            made.append(ns)
            veth = f"fwv{net.tag}{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{net.ip(name)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield net
    finally:
        net.stop_all()
        for ns in made:  # its end of the veth goes with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


# ---- the delaying relay ------------------------------------------------------------------
async def _carry(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 delay_s: float) -> None:
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def deliver() -> None:
        while True:
            due, chunk = await queue.get()
            await asyncio.sleep(max(0.0, due - loop.time()))
            if not chunk:
                writer.close()
                return
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.create_task(deliver())
    try:
        while chunk := await reader.read(1 << 16):
            queue.put_nowait((loop.time() + delay_s, chunk))
    except ConnectionError:
        pass
    queue.put_nowait((loop.time() + delay_s, b""))
    with contextlib.suppress(ConnectionError):
        await sender


async def relay(listen: str, target: str, delay_ms: float) -> None:
    (host, port), (to_host, to_port) = (a.rsplit(":", 1) for a in (listen, target))

    async def connected(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(to_host, int(to_port))
        except OSError:
            writer.close()
            return
        await asyncio.gather(_carry(reader, up_writer, delay_ms / 1000),
                             _carry(up_reader, writer, delay_ms / 1000))

    server = await asyncio.start_server(connected, host, int(port))
    print(f"relay {listen} -> {target} (+{delay_ms:g} ms each way)", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "relay":
        sys.exit("usage: python -m tests.integration.netns relay HOST:PORT HOST:PORT DELAY_MS")
    asyncio.run(relay(sys.argv[2], sys.argv[3], float(sys.argv[4])))
