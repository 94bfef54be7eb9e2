#!/usr/bin/env python3
"""oci-layout.py [--cmd ARG]... LAYOUT LAYER.tar...: an OCI image layout (tag `latest`) whose
layers are the given uncompressed tars, bottom first (moved into the layout); `--cmd` sets the
config's Cmd (an ordinary container image; none: a data image). `skopeo copy
--dest-compress-format gzip` then publishes it as an ordinary gzip image: the benchmarks'
ordinary containerDisk baseline and ordinary container images, and the vmdisk node image
(packaging/image.sh)."""
import hashlib, json, os, sys
args, cmd = sys.argv[1:], []
while args and args[0] == "--cmd":
    cmd.append(args[1]); args = args[2:]
layout, layers = args[0], args[1:]
blobs = os.path.join(layout, "blobs", "sha256"); os.makedirs(blobs, exist_ok=True)
digests = []
for layer in layers:
    h = hashlib.sha256()
    with open(layer, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""): h.update(block)
    digests.append(h.hexdigest()); os.rename(layer, os.path.join(blobs, digests[-1]))
def put(obj):
    data = json.dumps(obj).encode(); d = hashlib.sha256(data).hexdigest()
    open(os.path.join(blobs, d), "wb").write(data); return d, len(data)
cd, cs = put({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": ["sha256:" + d for d in digests]},
  "config": {"Cmd": cmd} if cmd else {}})
md, ms = put({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
  "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + cd, "size": cs},
  "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:" + d, "size": os.path.getsize(os.path.join(blobs, d))} for d in digests]})
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + md, "size": ms, "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}, open(os.path.join(layout, "index.json"), "w"))
open(os.path.join(layout, "oci-layout"), "w").write('{"imageLayoutVersion":"1.0.0"}')
