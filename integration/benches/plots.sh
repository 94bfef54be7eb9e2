#!/usr/bin/env bash
# Plots of `make bench`'s figures (run at its end; docs/benchmarks.md and docs/fleet.md show
# them): integration/benches/plots.sh RESULTS OUTDIR reads the tables the benches wrote to RESULTS
# (scratch/bench/results.txt) and writes SVG plots with gnuplot (Debian's gnuplot-nox):
#   fleet-origin-bytes.svg  what the fleet cost the origin (multiples of the blob B) against the
#                           number of nodes, per cache and registry layout;
#   fleet-boot-p99.svg      the fleet's slowest boot (p99 s) against the number of nodes;
#   peers.svg               vmdisk beside SOCI and stargz-snapshotter, per measurement (the
#                           lazy rows: the full pulls' are in the table).
# Each plot is of the last table of its kind in RESULTS (the fleet's: every row of the last
# run's disk size, the later row where a mode and fleet size ran twice); a kind with no table is
# skipped. The data each plot was made from is written beside it (*.dat).
set -euo pipefail
results=${1:?usage: plots.sh RESULTS OUTDIR}
out=${2:?usage: plots.sh RESULTS OUTDIR}
mkdir -p "$out"
python3 - "$results" "$out" <<'PY'
import re, sys
results, out = sys.argv[1:]
lines = open(results).read().splitlines()

# The fleet: each table's header names the disk (MiB) and the origin's layout.
fleet = {}  # (mib, layout) -> {(mode, nodes): (x_blob, p99)}
i = 0
last_mib = None
while i < len(lines):
    head = lines[i]
    m = re.match(r"A fleet booting .*\((\d+) MiB of random data.*origin: ([^,]+)", head)
    if not m:
        i += 1
        continue
    mib = int(m.group(1))
    layout = "redirecting to a blob host" if "redirecting" in m.group(2) else "serving blobs itself"
    last_mib = mib
    i += 2
    while i < len(lines) and lines[i].startswith("  ") and lines[i].strip():
        f = lines[i].split()
        row = dict(zip(["mode", "nodes", "origin_mb", "x_b", "gets", "other", "p50", "p99"], f))
        fleet.setdefault((mib, layout), {})[(row["mode"], int(row["nodes"]))] = (row["x_b"], row["p99"])
        i += 1
if last_mib is not None:
    with open(f"{out}/fleet.dat", "w") as dat:
        for (mib, layout), rows in sorted(fleet.items()):
            if mib != last_mib:
                continue
            for mode in sorted({m for m, _ in rows}):
                points = sorted((n, v) for (m, n), v in rows.items() if m == mode)
                dat.write(f'"{mode}, registry {layout}" x_blob p99_s\n')
                for n, (xb, p99) in points:
                    dat.write(f"{n} {xb} {p99}\n")
                dat.write("\n\n")

# The peers: the last "Peers (" table.
starts = [k for k, l in enumerate(lines) if l.startswith("Peers (")]
if starts:
    k = starts[-1]
    while not lines[k].startswith("  index build"):
        k += 1
    # The bench prints 12 figures a row, each right-aligned in 11 columns.
    names = ["ready_s", "mb_10s", "bg_on_mb", "r64k_s", "r64k_gets", "miss_ms", "r4kx16_s",
             "r4k_mb", "full_mbps", "warm_s", "warm_mb", "first_warm_s"]
    rows = []
    k += 2
    while k < len(lines) and lines[k].startswith("  ") and not lines[k].startswith("  ranges"):
        f = lines[k].split()
        # The lazy rows: a row whose random reads sent no request pulled the whole image first
        # (SOCI's parallel pull, containerd's full pull), its pull 100x the others' ready.
        if len(f) == len(names) + 1 and float(f[names.index("r64k_gets") + 1]) > 0:
            rows.append(f)
        k += 1
    with open(f"{out}/peers.dat", "w") as dat:
        dat.write("row " + " ".join(names) + "\n")
        for f in rows:
            dat.write(" ".join(f) + "\n")
PY

if [ -s "$out/fleet.dat" ]; then
  for what in origin-bytes boot-p99; do
    case $what in
    origin-bytes) col=2; ylabel="bytes from the origin (multiples of the blob B)"; logy="set logscale y"; ymin=0.5 ;;
    boot-p99) col=3; ylabel="slowest boot, p99 (s)"; logy=""; ymin=0 ;;
    esac
    gnuplot <<GP
set terminal svg size 760,480 dynamic font "sans,12"
set output "$out/fleet-$what.svg"
set title "A fleet booting one disk at once (integration/benches/fleet.sh)"
set xlabel "nodes"
set ylabel "$ylabel"
set logscale x
$logy
set key below
set yrange [${ymin}:*]
set grid
# Per cache a colour; the registry serving blobs itself dashed.
set style line 1 lc rgb "#1b7837" lw 2 pt 7 dt 1
set style line 2 lc rgb "#c51b7d" lw 2 pt 7 dt 1
set style line 3 lc rgb "#1b7837" lw 2 pt 6 dt 2
set style line 4 lc rgb "#c51b7d" lw 2 pt 6 dt 2
stats "$out/fleet.dat" nooutput
plot for [i=0:STATS_blocks-1] "$out/fleet.dat" index i using 1:$col with linespoints ls i+1 title columnheader(1)
GP
  done
fi

if [ -s "$out/peers.dat" ]; then
  # One panel per measurement; every row of the table a bar.
  gnuplot <<GP
set terminal svg size 1100,760 dynamic font "sans,11"
set output "$out/peers.svg"
set multiplot layout 2,3 title "vmdisk beside the lazy peers, one disk, one link (integration/benches/peers.sh)"
set style data histogram
set style fill solid 0.8 border -1
set boxwidth 0.8
set xtics rotate by -35 left font ",9"
set grid y
set yrange [0:*]
unset key
array column[6] = [2, 5, 7, 8, 10, 11]
array heading[6] = ["PullImage to ready (s)", "1% of the file, random 64 KiB reads (s)", \
  "one cold 4 KiB read, median (ms)", "1% in 4 KiB reads by 16 readers (s)", \
  "whole file in order (MB/s)", "warm re-read (s)"]
do for [i=1:6] {
  set title heading[i]
  plot "$out/peers.dat" using column[i]:xtic(1) every ::1 notitle
}
unset multiplot
GP
fi
ls "$out"/*.svg 2>/dev/null || true
