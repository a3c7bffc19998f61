#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""plugins/ofi/bench/compare_ofi.py: ferry-bench over ofi (shm, tcp;ofi_rxm) beside
ferry's tcp backend, memcpy and UCX's shared-memory transports, in ONE run.

  python3 plugins/ofi/bench/compare_ofi.py [BUILD_DIR (build)] [--rounds N (3)] [--quick]

Every measurement runs once per round, in an order that rotates between rounds;
the tables show the best round of each (noise on a shared machine only ever
slows a run down). Only ratios within one run mean anything. Prints markdown.
References (skipped with a note when the tool is missing):
  memcpy_probe  one thread copying a buffer of the block's size (the same-host limit)
  ucx_perftest  UCX_TLS=posix,cma and UCX_TLS=sm: ucp_put_bw / ucp_get, ucp_put_lat
"""
import argparse, csv, datetime, os, platform, re, shutil, socket, subprocess, sys, tempfile, time

ap = argparse.ArgumentParser(formatter_class=argparse.RawDescriptionHelpFormatter, description=__doc__)
ap.add_argument("build", nargs="?", default="build")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--quick", action="store_true")
args = ap.parse_args()

bindir = os.path.join(args.build, "bin")
for tool in ("ferry-bench", "memcpy_probe"):
    if not os.access(os.path.join(bindir, tool), os.X_OK):
        sys.exit(f"compare_ofi: no {os.path.join(bindir, tool)}; build it first")
bench = os.path.join(bindir, "ferry-bench")
memcpy = os.path.join(bindir, "memcpy_probe")
have_ucx = shutil.which("ucx_perftest") is not None
tmp = tempfile.mkdtemp(prefix="ferry-ofi-compare-")
MiB = 1 << 20
BLOCKS = [4096, 64 << 10, MiB, 16 * MiB, 64 * MiB]
BACKENDS = {  # name in the tables -> ferry-bench arguments
    "ofi shm": ["--backend", "ofi", "--backend-settings", 'ofi={"provider":"shm"}'],
    "ofi rxm": ["--backend", "ofi", "--backend-settings", 'ofi={"provider":"tcp;ofi_rxm"}'],
    "tcp": ["--backend", "tcp"],
}
commands = {}
results = {}  # key -> list of values over rounds


def run(cmd, env=None, timeout=600):
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-400:]}")
    return p.stdout


def record(key, value):
    results.setdefault(key, []).append(value)


def shell(cmd):
    return " ".join("'" + c + "'" if any(ch in c for ch in ' ;{}"') else c for c in cmd)


def ferry(name, extra, tag):
    path = os.path.join(tmp, "out.csv")
    iters = ["--num-iter", "16" if args.quick else "32", "--warmup-iter", "4",
             "--large-block-iter-factor", "4", "--no-progress"]
    cmd = [bench] + BACKENDS[name] + iters + extra + ["--csv", path]  # later flags win
    commands[f"{name} {tag}"] = shell(cmd).replace(bench, "build/bin/ferry-bench")
    run(cmd)
    with open(path) as f:
        return list(csv.DictReader(f))


def m_ferry_sweep(name, op):
    def m():
        rows = ferry(name, ["--op", op, "--start-block-size", "4KiB", "--max-block-size", "64MiB",
                            "--block-multiplier", "4"], f"{op} sweep")
        for r in rows:
            b = int(r["block_bytes"])
            if b in BLOCKS:
                record((name, op, b, 1), float(r["bw_gbs"]))
    return m


def m_ferry_batch(name):
    def m():
        rows = ferry(name, ["--op", "WRITE", "--start-block-size", "4KiB", "--max-block-size", "4KiB",
                            "--start-batch-size", "128", "--max-batch-size", "128"], "WRITE 4KiB x 128")
        record((name, "WRITE", 4096, 128), float(rows[0]["bw_gbs"]))
    return m


def m_ferry_lat(name):
    def m():
        rows = ferry(name, ["--op", "WRITE", "--start-block-size", "8", "--max-block-size", "8",
                            "--num-iter", "2000", "--no-notify"], "8B latency")
        record((name, "lat avg"), float(rows[0]["avg_lat_us"]))
        record((name, "lat p50"), float(rows[0]["p50_lat_us"]))
        record((name, "lat min"), float(rows[0]["min_lat_us"]))
    return m


def m_memcpy():
    for b in (16 * MiB, 64 * MiB):  # smaller buffers copy from cache: no fair limit
        reps = str(max(10, (256 * MiB) // b))
        cmd = [memcpy, str(b), reps]
        commands[f"memcpy {b}"] = shell(cmd).replace(memcpy, "build/bin/memcpy_probe")
        out = run(cmd)
        m = re.search(r"best ([0-9.]+) GB/s, median ([0-9.]+) GB/s", out)
        if not m:
            raise RuntimeError("memcpy_probe printed no figure: " + out)
        record(("memcpy", b), float(m.group(2)))  # the median: a copy's typical speed


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listening(port):
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            for line in open(f).read().splitlines()[1:]:
                parts = line.split()
                if parts[3] == "0A" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    return True
        except OSError:
            pass
    return False


def ucx(tls, test, size, extra, key):
    port = free_port()
    env = dict(os.environ, UCX_TLS=tls)
    srv = subprocess.Popen(["ucx_perftest", "-p", str(port)], env=env,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        end = time.monotonic() + 20
        while not listening(port):  # the server's listener, read from /proc (bounded)
            if time.monotonic() > end or srv.poll() is not None:
                raise RuntimeError("ucx_perftest server did not listen")
            time.sleep(0.01)  # polling a benchmark helper, not test synchronisation
        cmd = ["ucx_perftest", "127.0.0.1", "-p", str(port), "-t", test, "-s", str(size)] + extra
        commands[key] = (f"UCX_TLS={tls} ucx_perftest -p PORT & UCX_TLS={tls} " +
                         " ".join(cmd).replace(str(port), "PORT"))
        out = run(cmd, env=env, timeout=180)
    finally:
        try:
            srv.wait(timeout=10)
        except subprocess.TimeoutExpired:
            srv.kill()
            srv.wait()
    lines = [l for l in out.splitlines() if re.match(r"^\s*(Final:)?\s*\d+\s*,", l) or
             re.match(r"^\s*\[thread 0\]\s+\d+,", l)]
    if not lines:
        raise RuntimeError(f"no result from ucx_perftest {test}: {out[-300:]}")
    f = re.sub(r"^.*?(\d+,)", r"\1", lines[-1].strip()).split(",")
    # iterations, p50 lat, avg lat, overall lat (us), avg bw, overall bw (MB/s = MiB/s), ...
    return {"p50_us": float(f[1]), "lat_us": float(f[3]), "gbs": float(f[5]) * MiB / 1e9}


def m_ucx(tls):
    def m():
        n = "200" if args.quick else "1000"
        r = ucx(tls, "ucp_put_bw", 64 * MiB, ["-n", "16" if args.quick else "40", "-w", "4", "-v"],
                f"ucx {tls} put 64MiB")
        record((f"ucx {tls}", "WRITE", 64 * MiB, 1), r["gbs"])
        r = ucx(tls, "ucp_put_bw", 16 * MiB, ["-n", "40" if args.quick else "120", "-w", "8", "-v"],
                f"ucx {tls} put 16MiB")
        record((f"ucx {tls}", "WRITE", 16 * MiB, 1), r["gbs"])
        r = ucx(tls, "ucp_put_bw", MiB, ["-O", "16", "-n", n, "-w", "50", "-v"], f"ucx {tls} put 1MiB")
        record((f"ucx {tls}", "WRITE", MiB, 1), r["gbs"])
        r = ucx(tls, "ucp_get", MiB, ["-O", "16", "-n", n, "-w", "50", "-v"], f"ucx {tls} get 1MiB")
        record((f"ucx {tls}", "READ", MiB, 1), r["gbs"])
        r = ucx(tls, "ucp_put_bw", 4096, ["-O", "128", "-n", "20000", "-w", "1000", "-v"],
                f"ucx {tls} put 4KiB x128")
        record((f"ucx {tls}", "WRITE", 4096, 128), r["gbs"])
        r = ucx(tls, "ucp_put_lat", 8, ["-n", "20000", "-w", "2000", "-v"], f"ucx {tls} put_lat 8B")
        record((f"ucx {tls}", "lat avg"), r["lat_us"])  # its percentile column is not a latency
    return m


measurements = [("memcpy", m_memcpy)]
for name in BACKENDS:
    measurements += [(f"{name} WRITE", m_ferry_sweep(name, "WRITE")),
                     (f"{name} READ", m_ferry_sweep(name, "READ")),
                     (f"{name} batch", m_ferry_batch(name)), (f"{name} lat", m_ferry_lat(name))]
if have_ucx:
    measurements += [("ucx posix,cma", m_ucx("posix,cma")), ("ucx sm", m_ucx("sm"))]

notes = []
for rnd in range(args.rounds):
    k = rnd % len(measurements)
    for label, m in measurements[k:] + measurements[:k]:
        print(f"[round {rnd + 1}/{args.rounds}] {label}", file=sys.stderr, flush=True)
        try:
            m()
        except Exception as e:  # noqa: BLE001 - a failed reference is a note, not a crash
            notes.append(f"round {rnd + 1} {label}: {e}")


def best(key, lower=False):
    v = results.get(key)
    if not v:
        return None
    return min(v) if lower else max(v)


def fmt(x, digits=3):
    return "-" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return "-" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def out(s=""):
    print(s)


host = platform.node() or "?"
out(f"compare_ofi on {host}, {os.cpu_count()} CPUs, "
    f"{datetime.datetime.utcnow().strftime('%Y-%m-%dT%H:%MZ')}, best of {args.rounds} rounds")
out()
out("| op | block | batch | memcpy | ofi shm | ofi rxm | tcp | ucx posix,cma | ucx sm |"
    " shm / memcpy | shm / ucx sm | rxm / tcp |")
out("|---|---|---|---|---|---|---|---|---|---|---|---|")
rows = [("WRITE", b, 1) for b in BLOCKS] + [("READ", b, 1) for b in BLOCKS] + [("WRITE", 4096, 128)]
for op, b, batch in rows:
    mc = best(("memcpy", b)) if batch == 1 else None
    shm, rxm, tcp = (best((n, op, b, batch)) for n in ("ofi shm", "ofi rxm", "tcp"))
    u1, u2 = best(("ucx posix,cma", op, b, batch)), best(("ucx sm", op, b, batch))
    out(f"| {op} | {b} | {batch} | {fmt(mc)} | {fmt(shm)} | {fmt(rxm)} | {fmt(tcp)} | {fmt(u1)} |"
        f" {fmt(u2)} | {ratio(shm, mc)} | {ratio(shm, u2)} | {ratio(rxm, tcp)} |")
out()
out("GB/s (1e9 bytes/s). memcpy: memcpy_probe's median at the block size (one thread; only")
out("for blocks >= 16 MiB, smaller ones copy from cache). ucx 4 KiB x 128: ucp_put_bw with")
out("128 puts in flight of ONE cache-resident 4 KiB buffer; ferry's batch moves 512 KiB of")
out("distinct memory and is delivered (acknowledged) before it counts.")
out()
out("| 8 B WRITE latency, us | avg | p50 | min |")
out("|---|---|---|---|")
for n in ("ofi shm", "ofi rxm", "tcp", "ucx posix,cma", "ucx sm"):
    if best((n, "lat avg"), True) is None:
        continue
    out(f"| {n} | {fmt(best((n, 'lat avg'), True), 1)} | {fmt(best((n, 'lat p50'), True), 1)} |"
        f" {fmt(best((n, 'lat min'), True), 1)} |")
out()
out("ferry: post to SUCCESS (delivered, no notification), one transfer at a time;")
out("ucx_perftest ucp_put_lat: half a ping-pong of puts (its overall average).")
if notes:
    out()
    out("Notes:")
    for n in notes:
        out(f"- {n}")
out()
out("Commands:")
for k, v in commands.items():
    out(f"- {k}: `{v}`")
