#!/usr/bin/env python3
"""oci-layout.py LAYOUT LAYER.tar: an OCI image layout (tag `latest`) whose one layer is the
given uncompressed tar (moved into the layout). `skopeo copy --dest-compress-format gzip` then
publishes it as an ordinary gzip image: the benchmarks' ordinary containerDisk baseline, and
the vmdisk node image (packaging/image.sh)."""
import hashlib, json, os, sys
layout, layer = sys.argv[1], sys.argv[2]
blobs = os.path.join(layout, "blobs", "sha256"); os.makedirs(blobs, exist_ok=True)
h = hashlib.sha256()
with open(layer, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""): h.update(block)
ld = h.hexdigest(); os.rename(layer, os.path.join(blobs, ld))
def put(obj):
    data = json.dumps(obj).encode(); d = hashlib.sha256(data).hexdigest()
    open(os.path.join(blobs, d), "wb").write(data); return d, len(data)
cd, cs = put({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": ["sha256:" + ld]}, "config": {}})
md, ms = put({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
  "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + cd, "size": cs},
  "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": "sha256:" + ld, "size": os.path.getsize(os.path.join(blobs, ld))}]})
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": "sha256:" + md, "size": ms, "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}, open(os.path.join(layout, "index.json"), "w"))
open(os.path.join(layout, "oci-layout"), "w").write('{"imageLayoutVersion":"1.0.0"}')
