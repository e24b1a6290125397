"""Hostile-input attacks on `rdepth serve` (issues 19 and 33), old tree against new tree, side by side.

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

Issue 33 adds (`--only kv-spec,...`):

* kv-spec (item 9): completions with `kv_quant` `k=qjl:10000,v=mse:3` and `k=qjl:100000` (statuses);
* body-budget (item 11): 24 concurrent bodies of 31 MiB; how many got 200 / 503 / other;
* host-list, tokenizer (item 19): `Host: 127.0.0.1:80, evil.com`; `serve --tokenizer` at a missing
  path and at a FIFO (exit code, seconds, whether the model was loaded first);
* kernel-build (item 17): a fresh kernel cache; one request with `kv_quant` (its first build), and
  4-token requests meanwhile: the slowest of them (seconds) and the quantized one's time;
* shutdown (item 10): a fresh kernel cache, the first quantized request building, 11 more queued
  (4 of them streams), then SIGTERM: JSON 503s, plain-text 500s, streams without `[DONE]`,
  tracebacks in the log, seconds to exit;
* quant-batch (item 20): `--kv-quant` server, a `minp-kl` request at depth 32 alone, then the same
  request among 8 concurrent others, `--trials` times: tokens and per-token steps that differ.

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import torch
from _args import out_file

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
    p.add_argument("--trials", type=int, default=4, help="quant-batch: trials (default: %(default)s)")
    p.add_argument("--only", default=None, help="comma-separated attacks to run (default: all)")
    p.add_argument("--out", default=None, type=out_file, help="also write the JSON line to this file")
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


def server_env(tree: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src"), "OMP_NUM_THREADS": "1", **extra}
    env.pop("RDEPTH_API_KEY", None)
    return env


class Server:
    def __init__(self, tree: Path, model: Path, flags: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr, read by stderr(), closed in close()
        self.proc = subprocess.Popen([sys.executable, "-m", "recurrent_depth.cli", "serve", "--model", str(model),
                                      "--port", str(self.port), "--threads", "1", "--log-level", "warning", *flags],
                                     env=env or server_env(tree), stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.monotonic() + 900  # a --kv-quant server may build its kernels first
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError(f"server did not start: {self.stderr()[-2000:]}")
            time.sleep(0.2)

    def peak_rss(self) -> tuple[int, int]:
        """(server VmHWM, largest worker VmHWM) in MiB."""
        def hwm(pid: int) -> int:
            with open(f"/proc/{pid}/status") as f:
                return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmHWM"))
        workers = [c.pid for c in psutil.Process(self.proc.pid).children(recursive=True)]
        return hwm(self.proc.pid), max((hwm(w) for w in workers if psutil.pid_exists(w)), default=0)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


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
                try:
                    failed = c.get(self.url).status_code >= 500
                except httpx.HTTPError:  # the server is gone (the shutdown attack stops it)
                    break
                self.worst = max(self.worst, time.monotonic() - t)
                self.sent += 1
                self.errors += failed
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


# ---------------------------------------------------------------------------------------- issue 33
def kv_spec(url: str) -> dict:
    statuses = []
    for spec in ("k=qjl:10000,v=mse:3", "k=qjl:100000"):
        body = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4, "kv_quant": spec}).encode()
        try:
            statuses.append(post(url, "/v1/completions", body)["status"])
        except httpx.HTTPError as exc:  # the server died (out of memory) or hung past the client's limit
            statuses.append(type(exc).__name__)
    return {"status": statuses, "requests": len(statuses),
            "server_errors": sum(not isinstance(x, int) or x >= 500 for x in statuses)}


def body_budget(url: str) -> dict:
    text = json.dumps({"prompt": [5, 6, 7], "max_tokens": 1}).encode()
    body = text + b" " * (31 * 2**20 - len(text))

    def send(_: int) -> object:
        try:
            return post(url, "/v1/completions", body)["status"]
        except httpx.HTTPError as exc:  # the server closed the connection while the body was sent
            return type(exc).__name__

    with ThreadPoolExecutor(24) as pool:
        statuses = list(pool.map(send, range(24)))
    counts = {str(k): statuses.count(k) for k in sorted(set(statuses), key=str)}
    return {"status": counts, "requests": 24, "server_errors": sum(isinstance(x, int) and x >= 500 and x != 503
                                                                    for x in statuses)}


def host_list(port: int) -> dict:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1:80, evil.com\r\nConnection: close\r\n\r\n")
        answer = sock.recv(65536)
    return {"status": int(answer.split()[1]), "requests": 1}


def tokenizer_flags(tree: Path, model: Path, scratch: Path) -> dict:
    fifo = scratch / "fifo-tokenizer.json"
    if not fifo.exists():
        os.mkfifo(fifo)
    out = {}
    for name, path in (("missing", scratch / "nope"), ("fifo", fifo)):
        t = time.monotonic()
        try:
            done = subprocess.run([sys.executable, "-m", "recurrent_depth.cli", "serve", "--model", str(model),
                                   "--tokenizer", str(path), "--port", str(free_port()), "--threads", "1"],
                                  env=server_env(tree), capture_output=True, text=True, timeout=120)
            rc, said = done.returncode, (done.stderr.strip().splitlines() or [""])[-1][:120]
        except subprocess.TimeoutExpired:  # serving (token ids only), or blocked opening the FIFO
            rc, said = "running after 120 s", ""
        out[name] = {"rc": rc, "seconds": round(time.monotonic() - t, 2), "said": said}
    return {"status": {k: v["rc"] for k, v in out.items()}, "requests": 2, "detail": out, "server_errors": 0}


def timed_post(url: str, body: dict) -> tuple[object, float]:
    t = time.monotonic()
    try:
        status: object = httpx.post(url + "/v1/completions", json=body, timeout=600).status_code
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    return status, time.monotonic() - t


def kernel_build(url: str) -> dict:
    """A first quantized request (its kernels build) and 4-token requests sent meanwhile."""
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(timed_post, url, {"prompt": [5, 6, 7], "max_tokens": 4, "kv_quant": "k=prod:3.5,v=mse:3.5"})
        time.sleep(1.0)
        others = []
        while not first.done() and len(others) < 200:
            others.append(timed_post(url, {"prompt": [5, 6, 7], "max_tokens": 4}))
            time.sleep(0.5)
        status, took = first.result()
    return {"status": status, "requests": 1 + len(others), "quantized_s": round(took, 2),
            "others_max_s": round(max((t for _, t in others), default=0.0), 2),
            "others_ok": sum(s == 200 for s, _ in others)}


def shutdown(server: Server) -> dict:
    """The first quantized request building its kernels, 11 more queued, then SIGTERM."""
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "num_steps": 32}

    def plain(spec: str | None) -> str:
        try:
            r = httpx.post(server.url + "/v1/completions", json={**body, **({"kv_quant": spec} if spec else {})},
                           timeout=120)
        except httpx.HTTPError as exc:
            return f"cut ({type(exc).__name__})"
        json_body = r.headers.get("content-type", "").startswith("application/json")
        return f"{r.status_code} {'json' if json_body else 'text'}"

    def streamed(_: None) -> str:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
                lines = [line for line in r.iter_lines() if line]
        except httpx.HTTPError as exc:
            return f"cut ({type(exc).__name__})"
        if lines and lines[-1] == "data: [DONE]":
            return "stream error+[DONE]" if '"error"' in lines[-2] else "stream done"
        return "stream cut"

    with ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(plain, "k=prod:3.5,v=mse:3.5")]
        time.sleep(1.0)
        futures += [pool.submit(streamed if i % 3 == 0 else plain, None) for i in range(11)]
        time.sleep(1.5)
        peak = server.peak_rss()  # the process is gone afterwards
        t = time.monotonic()
        server.proc.terminate()
        answers = [f.result() for f in futures]
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.proc.wait(120)
    exited = round(time.monotonic() - t, 2)
    log = server.stderr()
    counts = {a: answers.count(a) for a in sorted(set(answers))}
    return {"status": counts, "requests": 12, "exit_s": exited, "peak": peak,
            "server_errors": sum(n for a, n in counts.items() if not a.startswith(("503 json", "stream error"))),
            "tracebacks": log.count("Traceback"),
            "graceful_exceeded": log.count("timeout graceful shutdown exceeded")}


def quant_batch(url: str, trials: int) -> dict:
    """A minp-kl request at depth 32 alone, then among 8 concurrent others; tokens and steps compared."""
    target = {"prompt": [17, 4, 99, 23, 8, 41, 7], "max_tokens": 24, "num_steps": 32, "exit_criterion": "minp-kl",
              "temperature": 0, "ignore_eos": True, "return_steps": True, "seed": 7}

    def run(body: dict) -> tuple[str, list[int]]:
        choice = httpx.post(url + "/v1/completions", json=body, timeout=600).json()["choices"][0]
        return choice["text"], choice.get("steps") or []

    alone = run(target)
    differ = []
    for trial in range(trials):
        others = [{"prompt": [(11 * trial + 3 * i + j) % 300 + 1 for j in range(3 + 5 * i)], "max_tokens": 16 + i,
                   "num_steps": 8 + 3 * i, "exit_criterion": "kl", "exit_threshold": 1e-3, "temperature": 0.8,
                   "seed": i, "ignore_eos": True} for i in range(8)]
        with ThreadPoolExecutor(9) as pool:
            load = [pool.submit(run, o) for o in others[:4]]
            time.sleep(0.05 * trial)
            mine = pool.submit(run, target)
            load += [pool.submit(run, o) for o in others[4:]]
            text, steps = mine.result()
            for f in load:
                f.result()
        differ.append({"tokens_equal": text == alone[0],
                       "steps_differ": sum(a != b for a, b in zip(steps, alone[1])) + abs(len(steps) - len(alone[1]))})
    return {"status": "exact" if all(d["tokens_equal"] and not d["steps_differ"] for d in differ) else "differs",
            "requests": 1 + 9 * trials, "trials": differ, "alone_steps": alone[1]}


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
        ("kv-spec", model, lambda s: kv_spec(s.url)),
        ("body-budget", model, lambda s: body_budget(s.url)),
        ("host-list", model, lambda s: host_list(s.port)),
        ("tokenizer", model, lambda s: tokenizer_flags(tree, model, hostile.parent)),
        ("kernel-build", model, lambda s: kernel_build(s.url)),
        ("shutdown", model, shutdown),
        ("quant-batch", model, lambda s: quant_batch(s.url, args.trials)),
    ]
    for name, directory, attack in attacks:
        if args.only and name not in args.only.split(","):
            continue
        flags: tuple[str, ...] = ("--kv-quant", "k=prod:3.5,v=mse:3.5") if name == "quant-batch" else ()
        env = None
        if name in ("kernel-build", "shutdown"):  # a machine's first build: an empty kernel cache
            cache = Path(tempfile.mkdtemp(prefix="kernels-", dir=hostile.parent))
            env = server_env(tree, XDG_CACHE_HOME=str(cache), RDEPTH_NO_CPP="0")
        server = Server(tree, directory, flags, env)
        try:
            before = server.peak_rss()
            probe = Probe(server.url)
            t = time.monotonic()
            result = attack(server)
            result["seconds"] = round(time.monotonic() - t, 2)
            probe.end()
            after = result.pop("peak") if "peak" in result else server.peak_rss()
            result.update(health_probes=probe.sent, max_health_latency_s=round(probe.worst, 3),
                          server_5xx=probe.errors + result.get("server_errors", int(isinstance(result["status"], int)
                                                                               and result["status"] >= 500)),
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
    cols = ["status", "requests", "server_5xx", "client_sent_mib", "held_after_s", "seconds", "exit_s",
            "max_health_latency_s", "server_vmhwm_before_mib", "server_vmhwm_mib", "worker_vmhwm_mib"]
    print("| tree | attack | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for tree, attacks in results.items():
        for name, r in attacks.items():
            print(f"| {Path(tree).name} | {name} | " + " | ".join(str(r.get(c, "")) for c in cols) + " |")


if __name__ == "__main__":
    main()
