#!/usr/bin/env bash
# The lab: the netns topology of testbed/netns (client, load balancer, two
# backends), the daemon running in the load balancer's namespace with the
# eBPF data plane on its interfaces, and two rules on it:
#
#   172.30.100.1:80  mode 0 (DNAT, in the kernel)  -> be1, be2 :8080
#   172.30.100.2:80  mode 4 (fullproxy, the proxy) -> be1, be2 :8080
#
#   lab.sh up      build the topology, start the daemon, create the rules
#   lab.sh check   ask both VIPs from the client namespace; exit 1 unless both answer
#   lab.sh down    stop the daemon, `loxilb cleanup`, delete the namespaces
#   lab.sh test    up, check, down (down even when check fails)
#
# Needs root and the built binaries (LAB_BIN, default <repo>/bin: loxilb,
# loxicmd). LAB_PREFIX (default lab) names the namespaces <prefix>-cli,
# <prefix>-lb, <prefix>-be1.. and the pin path /sys/fs/bpf/<prefix>-loxilb,
# so two labs can run side by side. State and logs: /run/<prefix>-loxilb.
# The rules route plain HTTP, so no tokenizer is staged; LAB_TOKENIZERS
# names a directory of staged tokenizers (e.g. <repo>/testdata/tokenizers)
# for trying KV-aware mode-4 rules by hand.
set -euo pipefail

repo=$(cd "$(dirname "$0")/../.." && pwd)
LAB_PREFIX=${LAB_PREFIX:-lab}
LAB_BIN=${LAB_BIN:-$repo/bin}
export LAB_PREFIX
run_dir=/run/$LAB_PREFIX-loxilb
pin=/sys/fs/bpf/$LAB_PREFIX-loxilb
lb=$LAB_PREFIX-lb
cli=$LAB_PREFIX-cli
vip0=172.30.100.1
vip4=172.30.100.2
backends=2

# in_ns runs a command in a namespace's network only: the daemon's pins
# must land on the host's bpffs, which `ip netns exec` would hide. Processes
# started in the background call setsid and nsenter directly, so that $! is
# their pid (both exec the command) and they outlive the provisioner's
# session.
in_ns() {
	local ns=$1
	shift
	nsenter --net="/run/netns/$ns" "$@"
}

need() {
	if [ "$(id -u)" != 0 ]; then
		echo "lab.sh: needs root (network namespaces, BPF)" >&2
		exit 1
	fi
	for b in loxilb loxicmd; do
		if [ ! -x "$LAB_BIN/$b" ]; then
			echo "lab.sh: $LAB_BIN/$b is missing: build it first (make build, or set LAB_BIN)" >&2
			exit 1
		fi
	done
	mountpoint -q /sys/fs/bpf || mount -t bpf bpf /sys/fs/bpf
}

# backend_server serves "name=beN" on :8080 in backend namespace N.
backend_server() {
	local i=$1 dir=$run_dir/be$i
	mkdir -p "$dir"
	echo "name=be$i" >"$dir/index.html"
	setsid nsenter --net="/run/netns/$LAB_PREFIX-be$i" python3 -m http.server 8080 --bind 0.0.0.0 --directory "$dir" \
		</dev/null >"$run_dir/be$i.log" 2>&1 &
	echo $! >"$run_dir/be$i.pid"
}

wait_for() { # description, command...
	local what=$1
	shift
	for _ in $(seq 1 150); do
		if "$@" >/dev/null 2>&1; then
			return 0
		fi
		sleep 0.2
	done
	echo "lab.sh: $what did not come up" >&2
	return 1
}

up() {
	need
	down_quiet
	mkdir -p "$run_dir"
	LAB_PYTHON=0 sh "$repo/testbed/netns/lab.sh" up "$backends"
	for i in $(seq 1 "$backends"); do
		backend_server "$i"
	done
	for i in $(seq 1 "$backends"); do
		wait_for "backend be$i" in_ns "$LAB_PREFIX-be$i" curl -sf --max-time 1 http://127.0.0.1:8080/
	done
	local ifaces=l0
	for i in $(seq 1 "$backends"); do ifaces="$ifaces,b$i"; done
	setsid nsenter --net="/run/netns/$lb" "$LAB_BIN/loxilb" --interfaces "$ifaces" --bpf-pin-path "$pin" \
		--state-dir "$run_dir/state" --tokenizer-dir "${LAB_TOKENIZERS:-$run_dir/tokenizers}" \
		--api-addr 127.0.0.1:11111 </dev/null >"$run_dir/loxilb.log" 2>&1 &
	echo $! >"$run_dir/loxilb.pid"
	if ! wait_for "the daemon (log: $run_dir/loxilb.log)" in_ns "$lb" curl -sf --max-time 1 http://127.0.0.1:11111/netlox/v1/version; then
		tail -n 20 "$run_dir/loxilb.log" >&2
		return 1
	fi
	local eps=""
	for i in $(seq 1 "$backends"); do eps="$eps${eps:+,}172.30.$((10 + i)).2:1"; done
	in_ns "$lb" "$LAB_BIN/loxicmd" -t 60s create lb "$vip0" --tcp=80:8080 --endpoints="$eps" --mode=default --select=rr
	in_ns "$lb" "$LAB_BIN/loxicmd" -t 60s create lb "$vip4" --tcp=80:8080 --endpoints="$eps" --mode=fullproxy --select=rr
	in_ns "$lb" "$LAB_BIN/loxicmd" get lb -o wide
	echo "lab up: daemon pid $(cat "$run_dir/loxilb.pid") in $lb (log $run_dir/loxilb.log, pin path $pin)"
	echo "try: nsenter --net=/run/netns/$cli curl -s http://$vip0/    # mode 0"
	echo "     nsenter --net=/run/netns/$cli curl -s http://$vip4/    # mode 4"
}

# check asks each VIP four times from the client. The backends' access logs
# then tell the paths apart: mode 0 rewrites only the destination, so the
# backend sees the client (172.30.1.2); mode 4 is a new connection from the
# proxy on the load balancer (172.30.1x.1). Only `GET /` lines count: the
# daemon also reads the endpoints' /metrics.
check() {
	local ok=0 vip mode out i before after
	for vm in "$vip0:0:172.30.1.2:the client" "$vip4:4:172.30.1[0-9].1:the proxy"; do
		IFS=: read -r vip mode src who <<<"$vm"
		before=$(cat "$run_dir"/be*.log 2>/dev/null | grep -c "^$src - .*\"GET / HTTP" || true)
		for i in 1 2 3 4; do
			if out=$(in_ns "$cli" curl -sS --max-time 5 "http://$vip/" 2>&1) && [[ $out == name=be* ]]; then
				echo "mode $mode $vip: answer $i from ${out#name=}"
			else
				echo "mode $mode $vip: request $i failed: $out"
				ok=1
			fi
		done
		sleep 0.2 # the access log line follows the answer
		after=$(cat "$run_dir"/be*.log 2>/dev/null | grep -c "^$src - .*\"GET / HTTP" || true)
		if [ $((after - before)) -ne 4 ]; then
			echo "mode $mode $vip: the backends logged $((after - before)) requests from $who, want 4"
			ok=1
		else
			echo "mode $mode $vip: the backends saw the 4 requests come from $who"
		fi
	done
	return $ok
}

down_quiet() {
	if [ -f "$run_dir/loxilb.pid" ]; then
		local pid
		pid=$(cat "$run_dir/loxilb.pid")
		if kill "$pid" 2>/dev/null; then
			for _ in $(seq 1 50); do
				kill -0 "$pid" 2>/dev/null || break
				sleep 0.1
			done
			kill -9 "$pid" 2>/dev/null || true
		fi
	fi
	# Pins and links outlive the daemon: cleanup removes them, in the LB
	# namespace (its routes), or in an empty one when that is gone.
	if [ -x "$LAB_BIN/loxilb" ]; then
		if [ -e "/run/netns/$lb" ]; then
			in_ns "$lb" "$LAB_BIN/loxilb" cleanup --bpf-pin-path "$pin"
		elif [ -e "$pin" ]; then
			unshare --net "$LAB_BIN/loxilb" cleanup --bpf-pin-path "$pin"
		fi
	fi
	for f in "$run_dir"/be*.pid; do
		[ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
	done
	LAB_PYTHON=0 sh "$repo/testbed/netns/lab.sh" down
	rm -rf "$run_dir"
}

down() {
	if [ "$(id -u)" != 0 ]; then
		echo "lab.sh: needs root" >&2
		exit 1
	fi
	down_quiet
	echo "lab down"
}

case "${1:-}" in
up) up ;;
check) check ;;
down) down ;;
test)
	trap down EXIT
	up
	check
	;;
*)
	echo "usage: $0 up | check | down | test" >&2
	exit 2
	;;
esac
