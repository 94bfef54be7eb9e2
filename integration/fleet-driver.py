#!/usr/bin/env python3
"""The nodes of bench-fleet.sh, started and timed by one process (so the harness's own CPU stays
small beside 100 nodes): each node is a `vmdisk mount` with its own cache, or with --full a
`curl` downloading the disk's whole blob (what a pull fetches); a thread per node waits for
its disk and reads the boot set (one 64 KiB pread per line of READS), timing the node from
its start. Prints one JSON object: the nodes' times (null: failed), how long each node's
threads (its mount's and its reader) waited for a CPU, and the CPU seconds the nodes, this
driver and the processes named by --watch used during the run.

usage: fleet-driver.py DIR N --reads FILE (--vmdisk BIN --reference REF --hosts-dir DIR
       [--mirror-note URL] | --full URL) [--watch NAME=PID]...   (bench-fleet.sh runs it)
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
    p.add_argument("--mirror-note", help="a pull-through cache each node has noted already")
    p.add_argument("--full", help="download this URL whole instead of mounting")
    p.add_argument("--watch", action="append", default=[], help="NAME=PID of a harness process")
    a = p.parse_args()
    offsets = [int(l) for l in open(a.reads)]
    watch = {}
    for w in a.watch:
        name, pid = w.split("=")
        watch.setdefault(name, []).extend(family(int(pid)))
    before = {n: sum(cpu(p) for p in ps) for n, ps in watch.items()}
    self_before = resource.getrusage(resource.RUSAGE_SELF)
    times = [None] * a.nodes
    procs = [None] * a.nodes
    node_cpu = [0.0] * a.nodes
    node_wait = [0.0] * a.nodes
    start = time.monotonic()

    def node(i):
        d = os.path.join(a.dir, f"node{i}")
        os.makedirs(os.path.join(d, "mnt"), exist_ok=True)
        os.makedirs(os.path.join(d, "cache"), exist_ok=True)
        t0 = time.monotonic()
        log = open(os.path.join(d, "node.log"), "w")
        if a.full:
            procs[i] = subprocess.Popen(["curl", "-sSf", "-o", "/dev/null", a.full], stderr=log)
            ok = procs[i].wait() == 0
        else:
            if a.mirror_note:
                with open(os.path.join(d, "cache", "mirrors"), "w") as f:
                    f.write(a.mirror_note + "\n")
            procs[i] = subprocess.Popen(
                [a.vmdisk, "mount", "--cache", os.path.join(d, "cache"), "--hosts-dir",
                 a.hosts_dir, "--timeout", "300", a.reference, os.path.join(d, "mnt")],
                stdout=subprocess.DEVNULL, stderr=log)
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
                try:
                    fd = os.open(disk, os.O_RDONLY)
                    for off in offsets:
                        os.pread(fd, 65536, off)
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
    for pr in procs:
        if pr is not None and pr.poll() is None:
            pr.send_signal(signal.SIGINT)
    for pr in procs:
        if pr is not None:
            try:
                pr.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pr.kill()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    json.dump({
        "times": times,
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
