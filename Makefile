# vmdisk developer entry points. `make demo` runs the main job on an embedded default,
# `make test` runs every test; both install what they need first (Debian 12, as root).

SHELL := /bin/bash
CARGO ?= cargo
# qemu-system-x86 and qemu-utils come from Debian 12 together (7.2): a preinstalled qemu-utils
# backport conflicts with Debian's qemu-system-x86 and is replaced. linux-image-amd64 and
# initramfs-tools give the kernel and initramfs the VM boot test boots (fdisk, e2fsprogs build
# its disk). libvirt-daemon-system and libvirt-clients: the peer-pod test's libvirt daemon.
# python3-yaml: the package test parses the Kubernetes manifests. xz-utils: the peer-pod
# artifact test packs its podvm.tar.xz as cloud-api-adaptor does. golang-go and
# golang-github-containerd-containerd-dev: containerd's snapshotter conformance suite, built
# offline from Debian's packaged source (integration/deps/conformance/). lintian: the package test
# checks the Debian package with it. gnuplot-nox: `make bench`'s plots (integration/benches/plots.sh).
APT_PACKAGES := containerd docker-registry skopeo openssl qemu-utils/bookworm qemu-system-x86 apache2-utils curl time \
	python3 fuse3 nbdkit fio tar ca-certificates busybox-static protobuf-compiler linux-image-amd64 \
	initramfs-tools fdisk e2fsprogs libvirt-daemon-system libvirt-clients python3-yaml xz-utils gzip \
	golang-go golang-github-containerd-containerd-dev lintian gnuplot-nox
# Commands those packages provide, to skip apt when all are present.
APT_COMMANDS := containerd ctr runc docker-registry skopeo openssl qemu-img qemu-io qemu-system-x86_64 htpasswd curl \
	/usr/bin/time fusermount3 nbdkit fio python3 busybox protoc sfdisk mkfs.ext4 virsh libvirtd virtlogd xz gzip go lintian \
	gnuplot

# What `make demo` uses, and nothing more (the tests' list above installs these too): containerd
# 1.6 (with ctr and runc), the registry, skopeo (the gzip containerDisk), qemu and its tools, the
# kernel and initramfs the guest boots, the tools that build its disk, python3 and curl for the
# script; and protobuf-compiler, which the build of the k8s-cri crate (the CRI API) runs (a
# fresh machine without it fails the release build). No cargo tool, no other containerd, no
# conformance suite, no libvirt, no lintian.
DEMO_APT_PACKAGES := containerd docker-registry skopeo qemu-utils/bookworm qemu-system-x86 curl python3 \
	busybox-static linux-image-amd64 initramfs-tools fdisk e2fsprogs ca-certificates tar gzip \
	protobuf-compiler
DEMO_APT_COMMANDS := containerd ctr runc docker-registry skopeo qemu-img qemu-io qemu-system-x86_64 curl \
	python3 busybox sfdisk mkfs.ext4 gzip protoc

# containerd 1.7 (Debian 13) and 2.1 (Debian unstable), unpacked beside Debian 12's 1.6 without
# installing them (integration/deps/debs.sh): the containerd matrix of the tests. The versions the
# tests were written against first; the suite's current one if the archive has moved on. Their
# Go sources with their Go compilers too: containerd's own snapshotter conformance suite of each
# release, built offline (integration/deps/conformance/).
DEPS_DIR := $(CURDIR)/target/deps
CONTAINERD_17 := containerd=1.7.24~ds1-6+deb13u1
CONTAINERD_21 := containerd=2.1.9+ds1-5
# containerd 2.3 (the long-term-support line) and 2.4 (the newest), which no Debian release
# carries: built from the Go module proxy by module version with the machine's Go
# (integration/deps/containerd-go.sh); their conformance suites the same way, when a test first runs
# them (integration/deps/conformance/build.sh --module). The Go: integration/deps/go.sh.
CONTAINERD_23 := v2.3.7
CONTAINERD_24 := v2.4.2
# The signing tools of the signature-policy test (Debian unstable's cosign and notation, Go
# programs that need only libc6 >= 2.34), unpacked the same way.
SIGNERS := cosign/sid notation/sid
# The regional cache of the fleet tests and bench: Debian 12's nginx (built with the slice
# module; `nginx-light` installs it), unpacked the same way so no web server starts on the
# machine. docs/fleet.md.
NGINX := nginx/bookworm
# The monitoring test's Prometheus and promtool: Debian 12's, unpacked the same way (no
# service starts). packaging/monitoring/, docs/install.md#monitoring.
PROMETHEUS := prometheus/bookworm

.PHONY: all deps demo-deps build demo test unit integration lint bench fuzz clean deb image

all: build

deps:
	@missing=0; for c in $(APT_COMMANDS); do command -v $$c >/dev/null 2>&1 || missing=1; done; \
	ls /boot/vmlinuz-* >/dev/null 2>&1 || missing=1; \
	[ -d /usr/share/gocode/src/github.com/containerd/containerd/snapshots/testsuite ] || missing=1; \
	python3 -c 'import yaml' 2>/dev/null || missing=1; \
	if [ $$missing = 1 ]; then \
		echo "installing test dependencies with apt-get"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends --allow-downgrades $(APT_PACKAGES) >/dev/null; \
	fi
	@$(CARGO) nextest --version >/dev/null 2>&1 || $(CARGO) install --locked cargo-nextest
	@[ -x $(DEPS_DIR)/containerd-1.7/usr/bin/containerd ] || \
		integration/deps/debs.sh $(DEPS_DIR)/containerd-1.7 $(CONTAINERD_17) || \
		integration/deps/debs.sh $(DEPS_DIR)/containerd-1.7 containerd/trixie
	@[ -x $(DEPS_DIR)/containerd-2.1/usr/bin/containerd ] || \
		integration/deps/debs.sh $(DEPS_DIR)/containerd-2.1 $(CONTAINERD_21) || \
		integration/deps/debs.sh $(DEPS_DIR)/containerd-2.1 containerd/sid
	@$(DEPS_DIR)/containerd-2.3/usr/bin/containerd --version 2>/dev/null | grep -qE ' $(subst .,[.],$(CONTAINERD_23:v%=%))( |$$)' || \
		integration/deps/containerd-go.sh $(DEPS_DIR)/containerd-2.3 $(CONTAINERD_23)
	@$(DEPS_DIR)/containerd-2.4/usr/bin/containerd --version 2>/dev/null | grep -qE ' $(subst .,[.],$(CONTAINERD_24:v%=%))( |$$)' || \
		integration/deps/containerd-go.sh $(DEPS_DIR)/containerd-2.4 $(CONTAINERD_24)
	@[ -x $(DEPS_DIR)/signers/usr/bin/cosign ] && [ -x $(DEPS_DIR)/signers/usr/bin/notation ] || \
		integration/deps/debs.sh $(DEPS_DIR)/signers $(SIGNERS)
	@[ -x $(DEPS_DIR)/nginx/usr/sbin/nginx ] || integration/deps/debs.sh $(DEPS_DIR)/nginx $(NGINX)
	@[ -x $(DEPS_DIR)/prometheus/usr/bin/prometheus ] || integration/deps/debs.sh $(DEPS_DIR)/prometheus $(PROMETHEUS)
	@[ -d $(DEPS_DIR)/suite-1.7/usr/share/gocode ] || \
		integration/deps/debs.sh --go-sources trixie $(DEPS_DIR)/suite-1.7 golang-github-containerd-containerd-dev golang-go
	@[ -d $(DEPS_DIR)/suite-2.1/usr/share/gocode ] || \
		integration/deps/debs.sh --go-sources sid $(DEPS_DIR)/suite-2.1 golang-github-containerd-containerd-dev golang-go

build:
	$(CARGO) build --release --locked --bins --example cri-pull --example shaped-link --example estargz-layout --example control-probe --example blob-cdn --example lab

# The demo's own packages only (DEMO_APT_PACKAGES), then the release build it runs.
demo-deps:
	@missing=0; for c in $(DEMO_APT_COMMANDS); do command -v $$c >/dev/null 2>&1 || missing=1; done; \
	ls /boot/vmlinuz-* >/dev/null 2>&1 || missing=1; \
	if [ $$missing = 1 ]; then \
		echo "installing the demo's packages with apt-get"; \
		export DEBIAN_FRONTEND=noninteractive; \
		apt-get update -qq && apt-get install -y -qq --no-install-recommends --allow-downgrades $(DEMO_APT_PACKAGES) >/dev/null; \
	fi

demo: demo-deps build
	integration/demo.sh

# The Debian package (target/deb/vmdisk_<version>_<arch>.deb) and the node image for the
# DaemonSet (packaging/kubernetes/vmdisk.yaml), from the release build.
deb:
	$(CARGO) build --release --locked --bins
	packaging/deb.sh target/release target/deb

IMAGE ?= 127.0.0.1:5000/vmdisk:0.1.0
image:
	$(CARGO) build --release --locked --bins
	packaging/image.sh target/release docker://$(IMAGE)

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --locked --all-targets -- -D warnings

unit:
	$(CARGO) nextest run --locked --lib --bins

integration: deps
	$(CARGO) nextest run --locked --test integration

# Each fuzz target for a bounded time, then every test (the test runner's summary closes the
# output).
CI_FUZZ_SECONDS ?= 30
test: deps lint
	$(MAKE) fuzz FUZZ_SECONDS=$(CI_FUZZ_SECONDS)
	$(CARGO) nextest run --locked --workspace --all-targets

bench: deps build
	integration/benches/all.sh

# Each fuzz target for FUZZ_SECONDS (cargo-fuzz, installed if missing), from the committed
# corpus (copied: new inputs are not written into the tree). 1 GiB of RSS or one allocation over
# 1 GiB is a failure: an allocation bomb fails the run. cargo-fuzz needs nightly features: the
# nightly toolchain where the machine has one, else the stable one with RUSTC_BOOTSTRAP=1 (no
# toolchain can be downloaded on these machines).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS := toc qcow2 manifest text_parsers layer_regions seekable_index
FUZZ_CARGO := $(if $(shell rustup toolchain list 2>/dev/null | grep '^nightly'),cargo +nightly,RUSTC_BOOTSTRAP=1 cargo +stable)
fuzz:
	@$(FUZZ_CARGO) fuzz --version >/dev/null 2>&1 || $(CARGO) install --locked cargo-fuzz
	@work=$$(mktemp -d) && trap 'rm -rf "$$work"' EXIT && cp -r fuzz/corpus/. "$$work"/ && \
	cd fuzz && for t in $(FUZZ_TARGETS); do \
		echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
		$(FUZZ_CARGO) fuzz run $$t "$$work/$$t" -- -max_total_time=$(FUZZ_SECONDS) \
			-rss_limit_mb=1024 -malloc_limit_mb=1024 -print_final_stats=1 2>&1 | \
			grep -E '^(stat::number_of_executed_units|stat::peak_rss_mb|==|SUMMARY|Done)|panicked|ERROR' ; \
		test $${PIPESTATUS[0]} -eq 0 || exit 1; done

clean:
	$(CARGO) clean
	rm -rf scratch
