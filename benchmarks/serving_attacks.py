"""Hostile-input attacks on `rdepth serve` (issue 19), old tree against new tree, side by side.

    python benchmarks/serving_attacks.py --base /work/wt/server-base      # base commit vs this tree

Builds a tiny model directory (random `tiny` preset, byte-level BPE of 320 tokens, context 256),
then for each source tree (`--base` and this one) starts `rdepth serve` from that tree's `src/`
in a subprocess on 127.0.0.1, one fresh server per attack, and measures:

* chunked: one POST with `Transfer-Encoding: chunked` of `--chunks` x 1 MiB; bytes the client got
  to send before the answer (or the hang-up), the status;
* big-prompt: one completion with a `--prompt-mb` MB text prompt;
* token-list: one completion with a 3,000,000-id prompt (9 MB of JSON);
* template: a chat request on a directory whose template nests two range(1000) loops (1M characters);
* slow-body: 200 connections that announce a 100-byte body and send 10 bytes; how many the server
  still holds after `--hold-s` seconds.

For each: the status, requests sent, 5xx answers (the attack's and the /health probes'), the
server's peak RSS (VmHWM of the server process; workers' peak separately), and the event-loop
stall: the slowest of the /health requests sent every 20 ms during the attack. Prints one JSON
line, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil
import torch

import recurrent_depth as rd
from recurrent_depth.data.tokenizer import save_tokenizer, special_token_ids, train_tokenizer

CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog. " * 4,
          "for i in range(10):\n    print(i * i)\n", "héllo wörld, ünïcode text 🙂 and more text.\n"] * 4
TEMPLATE = "{% for i in range(1000) %}{% for j in range(1000) %}x{% endfor %}{% endfor %}"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", default=None, help="source tree of the 'before' run (default: only this tree)")
    p.add_argument("--chunks", type=int, default=100,
                   help="1 MiB chunks of the chunked attack (default: %(default)s)")
    p.add_argument("--prompt-mb", type=float, default=10.0, help="size of the big prompt (default: %(default)s)")
    p.add_argument("--hold-s", type=float, default=35.0,
                   help="slow-body: seconds before counting (default: %(default)s)")
    p.add_argument("--only", default=None, help="comma-separated attacks to run (default: all)")
    p.add_argument("--out", default=None, help="also write the JSON line to this file")
    return p.parse_args()


def make_model(out: Path) -> Path:
    torch.manual_seed(0)
    tok = train_tokenizer(CORPUS, 320)
    save_tokenizer(tok, out)
    cfg = rd.ModelConfig.from_preset("tiny", vocab_size=320, eos_token_id=special_token_ids(tok)["end_text"])
    rd.RecurrentDepthLM(cfg).save_pretrained(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, tree: Path, model: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1"}
        env.pop("RDEPTH_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "recurrent_depth.cli", "serve", "--model", str(model),
                                      "--port", str(self.port), "--threads", "1", "--log-level", "warning"],
                                     env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"server did not start: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.2)

    def peak_rss(self) -> tuple[int, int]:
        """(server VmHWM, largest worker VmHWM) in MiB."""
        def hwm(pid: int) -> int:
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))
        workers = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        return hwm(self.proc.pid), max((hwm(w) for w in workers if psutil.pid_exists(w)), default=0)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class Probe:
    """GET /health every 20 ms: the slowest answer is the event loop's longest stall."""

    def __init__(self, url: str) -> None:
        self.url, self.worst, self.sent, self.errors = url + "/health", 0.0, 0, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        with httpx.Client(timeout=120) as c:
            while not self.stop.is_set():
                t = time.monotonic()
                r = c.get(self.url)
                self.worst = max(self.worst, time.monotonic() - t)
                self.sent += 1
                self.errors += r.status_code >= 500
                time.sleep(0.02)

    def end(self) -> None:
        time.sleep(0.3)
        self.stop.set()
        self.thread.join(300)


def chunked(url: str, port: int, chunks: int) -> dict:
    sock = socket.create_connection(("127.0.0.1", port), timeout=120)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 b"Transfer-Encoding: chunked\r\n\r\n")
    chunk = b"x" * (1 << 20)
    sent, answer = 0, b""
    sock.settimeout(0.05)
    for _ in range(chunks):
        try:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            break
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            answer += sock.recv(65536)
        if answer:
            break
    if not answer:
        with contextlib.suppress(OSError):
            sock.sendall(b"0\r\n\r\n")
    sock.settimeout(120)
    try:
        while b"\r\n\r\n" not in answer and (more := sock.recv(65536)):
            answer += more
    except OSError:
        pass
    sock.close()
    status = int(answer.split()[1]) if answer.startswith(b"HTTP/") else None
    return {"status": status, "client_sent_mib": round(sent / 2**20, 1), "requests": 1}


def post(url: str, path: str, body: bytes) -> dict:
    r = httpx.post(url + path, content=body, headers={"Content-Type": "application/json"}, timeout=600)
    return {"status": r.status_code, "requests": 1}


def slow_body(port: int, n: int, hold: float) -> dict:
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{\"prompt\":")
        socks.append(s)
    time.sleep(hold)
    held = 0
    for s in socks:
        s.settimeout(0.01)
        try:
            data = s.recv(65536)
            held += 0 if data == b"" or data.startswith(b"HTTP/1.1 408") else 1
        except TimeoutError:
            held += 1  # nothing came and the connection is still open
        except OSError:
            pass
        s.close()
    return {"status": None, "requests": n, "held_after_s": held}


def run_tree(tree: Path, model: Path, hostile: Path, args: argparse.Namespace) -> dict:
    out = {}
    # Bodies are encoded before the probe starts: encoding 9 MB of JSON holds this process's GIL,
    # which would show as a stall of the probe thread that has nothing to do with the server.
    text = json.dumps({"prompt": "the quick brown fox " * int(args.prompt_mb * 1e6 / 20), "max_tokens": 1}).encode()
    ids = json.dumps({"prompt": [5] * 3_000_000, "max_tokens": 1}).encode()
    chat = json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}).encode()
    attacks = [
        ("chunked", model, lambda s: chunked(s.url, s.port, args.chunks)),
        ("big-prompt", model, lambda s: post(s.url, "/v1/completions", text)),
        ("token-list", model, lambda s: post(s.url, "/v1/completions", ids)),
        ("template", hostile, lambda s: post(s.url, "/v1/chat/completions", chat)),
        ("slow-body", model, lambda s: slow_body(s.port, 200, args.hold_s)),
    ]
    for name, directory, attack in attacks:
        if args.only and name not in args.only.split(","):
            continue
        server = Server(tree, directory)
        try:
            before = server.peak_rss()
            probe = Probe(server.url)
            t = time.monotonic()
            result = attack(server)
            result["seconds"] = round(time.monotonic() - t, 2)
            probe.end()
            after = server.peak_rss()
            result.update(health_probes=probe.sent, max_health_latency_s=round(probe.worst, 3),
                          server_5xx=probe.errors + int((result["status"] or 0) >= 500),
                          server_vmhwm_mib=after[0], server_vmhwm_before_mib=before[0], worker_vmhwm_mib=after[1])
        finally:
            server.close()
        out[name] = result
        print(f"  {tree.name} {name}: {result}", file=sys.stderr, flush=True)
    return out


def main() -> None:
    args = parse_args()
    here = Path(__file__).resolve().parents[1]
    trees = ([Path(args.base).resolve()] if args.base else []) + [here]
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model")
        hostile = Path(tmp) / "hostile"
        shutil.copytree(model, hostile)
        (hostile / "chat_template.jinja").write_text(TEMPLATE)
        cfg = json.loads((hostile / "tokenizer_config.json").read_text())
        cfg["chat_template"] = TEMPLATE
        (hostile / "tokenizer_config.json").write_text(json.dumps(cfg))
        results = {str(t): run_tree(t, model, hostile, args) for t in trees}
    record = {"benchmark": "serving_attacks", "machine": platform.processor() or platform.machine(),
              "cpus": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "results": results}
    line = json.dumps(record)
    print(line)
    if args.out:
        Path(args.out).write_text(line + "\n")
    cols = ["status", "requests", "server_5xx", "client_sent_mib", "held_after_s", "seconds",
            "max_health_latency_s", "server_vmhwm_before_mib", "server_vmhwm_mib", "worker_vmhwm_mib"]
    print("| tree | attack | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for tree, attacks in results.items():
        for name, r in attacks.items():
            print(f"| {Path(tree).name} | {name} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
