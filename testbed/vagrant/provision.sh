#!/usr/bin/env bash
# Provisions the lab VM (run as root by the Vagrantfile): installs the
# packages, Go and bpffs; reports whether the VM's clang rebuilds the
# committed BPF objects byte for byte (in a scratch copy: the checkout is
# never written by root); builds bin/loxilb, bin/loxicmd and bin/engine-sim
# as the checkout's owner, so the synced folder keeps its ownership and git
# (run by Go's VCS stamping and the Makefile) trusts the tree.
#
#   GO_VERSION   Go release to install (default below)
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
GO_VERSION=${GO_VERSION:-1.26.8}
export DEBIAN_FRONTEND=noninteractive

apt-get update -q
apt-get install -y -q --no-install-recommends \
	clang-14 llvm-14 libbpf-dev linux-libc-dev gcc make git \
	iproute2 util-linux curl wrk nftables python3 ca-certificates
arch=$(dpkg --print-architecture)
if ! /usr/local/go/bin/go version 2>/dev/null | grep -q "go$GO_VERSION "; then
	curl -fsSL "https://go.dev/dl/go$GO_VERSION.linux-$arch.tar.gz" -o /tmp/go.tgz
	rm -rf /usr/local/go && tar -C /usr/local -xzf /tmp/go.tgz
	rm -f /tmp/go.tgz
fi
ln -sf /usr/local/go/bin/go /usr/local/bin/go
ln -sf /usr/local/go/bin/gofmt /usr/local/bin/gofmt
mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf

owner=$(stat -c %U "$repo")
as_owner() {
	runuser -u "$owner" -- env HOME="$(getent passwd "$owner" | cut -d: -f6)" PATH="/usr/local/go/bin:$PATH" "$@"
}

# Freshness of the committed BPF objects. The objects are built with
# Debian 12's clang 14; another distribution's clang 14 may emit other
# bytes, which is reported, never fatal: the lab runs the committed objects.
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
chown "$owner" "$scratch"
as_owner sh -c 'cd "$1" && cp -r go.mod go.sum bpf "$2"/ && mkdir -p "$2/pkg/dataplane" && cp -r pkg/dataplane/ebpf "$2/pkg/dataplane/"' _ "$repo" "$scratch"
if as_owner sh -c 'cd "$1" && sh bpf/gen.sh' _ "$scratch" >"$scratch/gen.log" 2>&1; then
	stale=""
	for f in lb_bpfel.o lb_bpfeb.o lb_bpfel.go lb_bpfeb.go; do
		cmp -s "$repo/pkg/dataplane/ebpf/$f" "$scratch/pkg/dataplane/ebpf/$f" || stale="$stale $f"
	done
	if [ -z "$stale" ]; then
		echo "BPF objects: fresh (this VM's clang 14 rebuilds the committed bytes)"
	else
		echo "BPF objects: this VM's clang 14 builds other bytes for$stale than the committed ones" \
			"(built on Debian 12; make check-generated there); the lab uses the committed objects"
	fi
else
	echo "BPF objects: could not regenerate for comparison (the lab uses the committed objects):"
	tail -n 5 "$scratch/gen.log"
fi

as_owner make -C "$repo" build
echo "built: $(ls "$repo/bin" | tr '\n' ' ')"
