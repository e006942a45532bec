#!/bin/sh
# Runs every data-plane test that needs privileges, as CI does: packet
# fixtures, conformance, pinning, sk_lookup, and the netns lab end to end.
# Must run as root. With BENCH=1 it also runs the benchmarks.
set -eu
cd "$(dirname "$0")/../.."
if [ "$(id -u)" != 0 ]; then
	echo "run.sh: needs root (BPF, network namespaces)" >&2
	exit 1
fi
export CI=true
go test -count=1 -p 1 -v ./pkg/dataplane/... ./testbed/netns/
if [ "${BENCH:-0}" = 1 ]; then
	go test -count=1 -p 1 -run '^$' -bench . ./pkg/dataplane/ebpf/ ./testbed/netns/
fi
