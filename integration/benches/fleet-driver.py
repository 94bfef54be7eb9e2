#!/usr/bin/env python3
"""The nodes of benches/fleet.sh, started and timed by one process (so the harness's own CPU stays
small beside 100 nodes): each node is a `vmdisk mount` with its own cache, run as the
snapshotter runs a layer by default (background hydration at 50 MB/s), or with --full a `curl`
downloading the disk's whole blob (what a pull fetches); a thread per node waits for its disk,
reads the boot set (one 64 KiB pread per line of READS, each compared with the same bytes of
--expect, the disk published), timing the node from its start, then waits until the node says
the whole disk is cached and checked ("hydrated"). With --late, the last node starts only once
the others have booted (while they hydrate) and reads --late-reads. Prints one JSON object: the
nodes' boot times (null: failed), when each node's disk appeared (mounted), their hydration times, wrong reads, how long each node's
threads (its mount's and its reader) waited for a CPU during its boot, and the CPU seconds the
nodes, this driver and the processes named by --watch used during the run.

usage: fleet-driver.py DIR N --reads FILE (--vmdisk BIN --reference REF --hosts-dir DIR
       --expect FILE [--late --late-reads FILE] | --full URL) [--watch NAME=PID]...
       (benches/fleet.sh runs it)
"""
import argparse, json, os, resource, signal, subprocess, sys, threading, time

TICK = os.sysconf("SC_CLK_TCK")


def cpu(pid):
    """CPU seconds (user + system) of pid and its children it waited for; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15]) / TICK
    except (OSError, IndexError):
        return 0.0


def waited(pid, tids=None):
    """Seconds the threads of pid (or those of tids) spent ready to run but waiting for a CPU
    (schedstat's run_delay): what a node with a CPU of its own would not have waited."""
    total = 0
    for tid in tids if tids is not None else os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def family(pid):
    """pid and its children (an nginx master's workers)."""
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                pids += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return pids


def main():
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("nodes", type=int)
    p.add_argument("--reads", required=True)
    p.add_argument("--vmdisk")
    p.add_argument("--reference")
    p.add_argument("--hosts-dir")
    p.add_argument("--expect", help="the disk published: what every read must return")
    p.add_argument("--late", action="store_true", help="start the last node once the others booted")
    p.add_argument("--late-reads", help="the late node's boot set")
    p.add_argument("--full", help="download this URL whole instead of mounting")
    p.add_argument("--watch", action="append", default=[], help="NAME=PID of a harness process")
    a = p.parse_args()
    offsets = [int(l) for l in open(a.reads)]
    late_offsets = [int(l) for l in open(a.late_reads)] if a.late_reads else offsets
    expect = open(a.expect, "rb") if a.expect else None
    watch = {}
    for w in a.watch:
        name, pid = w.split("=")
        watch.setdefault(name, []).extend(family(int(pid)))
    before = {n: sum(cpu(p) for p in ps) for n, ps in watch.items()}
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    times = [None] * a.nodes
    mounted = [None] * a.nodes
    hydrated = [None] * a.nodes
    wrong = [0]
    booted = threading.Semaphore(0)
    procs = [None] * a.nodes
    node_cpu = [0.0] * a.nodes
    node_wait = [0.0] * a.nodes
    start = time.monotonic()

    def node(i):
        d = os.path.join(a.dir, f"node{i}")
        os.makedirs(os.path.join(d, "mnt"), exist_ok=True)
        os.makedirs(os.path.join(d, "cache"), exist_ok=True)
        late = a.late and i == a.nodes - 1
        if late:
            for _ in range(a.nodes - 1):
                booted.acquire()
        t0 = time.monotonic()
        log = open(os.path.join(d, "node.log"), "w")
        if a.full:
            procs[i] = subprocess.Popen(["curl", "-sSf", "-o", "/dev/null", a.full], stderr=log)
            ok = procs[i].wait() == 0
        else:
            procs[i] = subprocess.Popen(
                [a.vmdisk, "mount", "--cache", os.path.join(d, "cache"), "--hosts-dir",
                 a.hosts_dir, "--timeout", "300", "--hydrate", "background", a.reference,
                 os.path.join(d, "mnt")],
                stdout=subprocess.PIPE, stderr=log, text=True)
            said_hydrated = threading.Event()

            def watch_stdout(out=procs[i].stdout):
                for line in out:
                    if line.startswith("hydrated"):
                        said_hydrated.set()
            threading.Thread(target=watch_stdout, daemon=True).start()
            disk = None
            while time.monotonic() - t0 < 300 and procs[i].poll() is None:
                found = [n for n in os.listdir(os.path.join(d, "mnt", "disk"))] \
                    if os.path.isdir(os.path.join(d, "mnt", "disk")) else []
                if found:
                    disk = os.path.join(d, "mnt", "disk", found[0])
                    break
                time.sleep(0.05)
            ok = disk is not None
            if ok:
                mounted[i] = round(time.monotonic() - t0, 3)
                try:
                    fd = os.open(disk, os.O_RDONLY)
                    for off in (late_offsets if late else offsets):
                        got = os.pread(fd, 65536, off)
                        if expect is not None and got != os.pread(expect.fileno(), 65536, off):
                            wrong[0] += 1
                    os.close(fd)
                except OSError as e:
                    print(f"node {i}: {e}", file=log)
                    ok = False
            node_cpu[i] = cpu(procs[i].pid)
            try:
                node_wait[i] = waited(procs[i].pid)
            except OSError:
                pass
        node_wait[i] += waited(os.getpid(), [threading.get_native_id()])
        times[i] = round(time.monotonic() - t0, 3) if ok else None
        if not late:
            booted.release()
        if ok and not a.full:
            if said_hydrated.wait(timeout=1200):
                hydrated[i] = round(time.monotonic() - start, 3)
            node_cpu[i] = cpu(procs[i].pid)

    def stop(*_):
        # Stopped (the bench is interrupted): the nodes unmount before the driver goes.
        for pr in procs:
            if pr is not None and pr.poll() is None:
                pr.send_signal(signal.SIGINT)
        os._exit(1)

    signal.signal(signal.SIGTERM, stop)
    threads = [threading.Thread(target=node, args=(i,), daemon=True) for i in range(a.nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    after = {n: sum(cpu(p) for p in ps) for n, ps in watch.items()}
    me = resource.getrusage(resource.RUSAGE_SELF)
    # The nodes unmount on SIGINT; a mount the kernel still finds busy asks to be signalled
    # again. Every node gets 30 s in all, then is killed (bench_cleanup unmounts what is left).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        alive = [pr for pr in procs if pr is not None and pr.poll() is None]
        if not alive:
            break
        for pr in alive:
            pr.send_signal(signal.SIGINT)
        time.sleep(2)
    for pr in procs:
        if pr is not None and pr.poll() is None:
            pr.kill()
            pr.wait()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    json.dump({
        "times": times,
        "mounted": mounted,
        "hydrated": hydrated,
        "wrong": wrong[0],
        "late": times[-1] if a.late else None,
        "cpu_waits": [round(w, 3) for w in node_wait],
        "wall": round(wall, 2),
        "cpu": {
            "nodes": round(sum(node_cpu) if not a.full else children.ru_utime + children.ru_stime, 1),
            "driver": round(me.ru_utime + me.ru_stime - self_before.ru_utime - self_before.ru_stime, 1),
            **{n: round(after[n] - before[n], 1) for n in watch},
        },
    }, sys.stdout)
    print()


if __name__ == "__main__":
    main()
