#!/usr/bin/env bash
# Runs the shipped regional cache (config/nginx-regional-cache.conf, Debian 12's nginx) in the
# foreground for the fleet tests and bench, in front of an origin on loopback (plain HTTP, or
# HTTPS with ORIGIN_CA below).
# Usage: regional-cache.sh DIR ORIGIN PORT [SLICE]
# (FETCHER_PORT, REDIRECTS_PORT: the loopback ports of its blob fetcher and of the server that
# keeps the origin's redirects, the shipped file's second and third servers; PORT+1 and PORT+2
# by default)
#   DIR     its configuration, cache, temporary files and logs (access.log: one line per
#           request with the cache's answer, HIT/MISS/…, the slice asked of the origin, and the
#           port of the server that answered: PORT's lines are the nodes' requests)
#   ORIGIN  host:port of the origin registry
#   PORT    where it listens (127.0.0.1)
#   SLICE   another slice size than the shipped one (the bench measures a few)
# The main context is what docs/fleet.md tells operators to set (worker_rlimit_nofile). The
# lines the shipped file marks EDIT are replaced; a line that is not found fails, so
# the tests run the file as shipped. NGINX names another nginx binary. With ORIGIN_CA (a CA
# certificate file) the origin is spoken to over HTTPS as the shipped file does, verified
# against that CA under the name ORIGIN_NAME (what its certificate names) instead of the
# system's CAs and registry.example.com.
set -euo pipefail
dir=${1:?usage: regional-cache.sh DIR ORIGIN PORT [SLICE]}
origin=${2:?origin host:port}
port=${3:?port}
slice=${4:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
nginx=${NGINX:-$here/target/deps/nginx/usr/sbin/nginx}
[ -x "$nginx" ] || nginx=$(command -v nginx) || {
  echo "regional-cache.sh: no nginx (make deps unpacks Debian's into target/deps/nginx)" >&2
  exit 1
}
mkdir -p "$dir/cache" "$dir/temp"
conf=$(<"$here/config/nginx-regional-cache.conf")
replace() {
  [[ $conf == *"$1"* ]] || { echo "regional-cache.sh: \"$1\" is not in the shipped config" >&2; exit 1; }
  conf=${conf//"$1"/"$2"}
}
replace "/var/cache/nginx/vmdisk" "$dir/cache"
replace "server registry.example.com:443;" "server $origin;"
replace "listen 5000;" "listen 127.0.0.1:$port;"
fetcher=${FETCHER_PORT:-$((port + 1))}
redirects=${REDIRECTS_PORT:-$((port + 2))}
replace "listen 127.0.0.1:5001;" "listen 127.0.0.1:$fetcher;"
replace "server 127.0.0.1:5001;" "server 127.0.0.1:$fetcher;"
replace "listen 127.0.0.1:5002;" "listen 127.0.0.1:$redirects;"
replace "server 127.0.0.1:5002;" "server 127.0.0.1:$redirects;"
if [ -n "${ORIGIN_CA:-}" ]; then
  replace "proxy_ssl_name registry.example.com;" "proxy_ssl_name ${ORIGIN_NAME:?the name in the certificate of the origin};"
  replace "proxy_ssl_trusted_certificate /etc/ssl/certs/ca-certificates.crt;" "proxy_ssl_trusted_certificate $ORIGIN_CA;"
else
  replace "https://vmdisk_origin" "http://vmdisk_origin"
fi
replace "Host registry.example.com" "Host $origin"
[ -z "$slice" ] || replace "slice 512k;" "slice $slice;"
printf '%s\n' "$conf" > "$dir/regional-cache.conf"
cat > "$dir/nginx.conf" <<CONF
daemon off;
user root;
worker_processes auto;
worker_rlimit_nofile 65536;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 8192; }
http {
    # As Debian's /etc/nginx/nginx.conf has them.
    sendfile on;
    tcp_nopush on;
    default_type application/octet-stream;
    log_format cache '\$request \$status \$upstream_cache_status \$slice_range \$body_bytes_sent \$server_port';
    access_log $dir/access.log cache;
    client_body_temp_path $dir/temp/body;
    proxy_temp_path $dir/temp/proxy;
    fastcgi_temp_path $dir/temp/fastcgi;
    uwsgi_temp_path $dir/temp/uwsgi;
    scgi_temp_path $dir/temp/scgi;
    include $dir/regional-cache.conf;
}
CONF
"$nginx" -t -q -p "$dir" -c "$dir/nginx.conf"
exec "$nginx" -p "$dir" -c "$dir/nginx.conf"
