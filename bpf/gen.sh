#!/bin/sh
# Regenerates the committed bpf2go output (pkg/dataplane/ebpf/lb_bpf{el,eb}.go
# and .o, little- and big-endian) from bpf/lb.c, and the benchmark's
# reference DNAT program (testbed/netns/refdnat_bpf{el,eb}_test.go and .o)
# from testbed/netns/refdnat.c. The object bytes depend on the compiler, so the
# compiler is pinned: Debian 12's clang 14 (packages clang-14, llvm-14).
# CI runs this and then `git diff --exit-code` to prove the committed files
# are fresh.
set -eu
cd "$(dirname "$0")/.."

CLANG=${BPF_CLANG:-clang-14}
STRIP=${BPF_STRIP:-llvm-strip-14}
want=14
have=$("$CLANG" -dumpversion | cut -d. -f1)
if [ "$have" != "$want" ]; then
	echo "gen.sh: $CLANG is clang $have; the committed objects are built with clang $want" >&2
	exit 1
fi

# Debian keeps asm/ under the multiarch include directory.
MULTIARCH=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)

go run github.com/cilium/ebpf/cmd/bpf2go \
	-go-package ebpf \
	-output-dir pkg/dataplane/ebpf \
	-output-stem lb \
	-target bpfel,bpfeb \
	-cc "$CLANG" \
	-strip "$STRIP" \
	-cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/$MULTIARCH" \
	-type lb_counter \
	lb bpf/lb.c

# Test files only (suffix _test): the reference is measured next to tc_lb by
# BenchmarkVIPThroughput and is no part of the product.
go run github.com/cilium/ebpf/cmd/bpf2go \
	-go-package netns \
	-output-dir testbed/netns \
	-output-stem refdnat \
	-output-suffix _test \
	-tags linux \
	-target bpfel,bpfeb \
	-cc "$CLANG" \
	-strip "$STRIP" \
	-cflags "-O2 -g -Wall -Werror -mcpu=v3 -I/usr/include/$MULTIARCH" \
	refdnat testbed/netns/refdnat.c
