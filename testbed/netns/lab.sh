#!/bin/sh
# Builds the netns lab by hand, for exploring the data plane interactively:
#
#   sh testbed/netns/lab.sh up [backends]   # default 3
#   sh testbed/netns/lab.sh down
#
# Same topology as the Go tests (see doc.go), with names lab-cli, lab-lb,
# lab-be1..N (LAB_PREFIX replaces "lab"). Addresses exist only inside these
# namespaces. Each backend runs `python3 -m http.server 8080` if python3 is
# present, unless LAB_PYTHON=0 (testbed/vagrant/lab.sh starts its own).
# Then e.g.: nsenter --net=/run/netns/lab-lb loxilb --interfaces l0,b1,b2,b3 ...
#            ip netns exec lab-cli curl http://172.30.100.1/
# (nsenter rather than `ip netns exec` for the daemon: the latter remounts
# /sys in a private mount namespace, so bpffs pins would not outlive it.)
set -eu

N=${2:-3}
P=${LAB_PREFIX:-lab}
ns_list() {
	echo "$P-cli" "$P-lb"
	i=1
	while [ "$i" -le "$N" ]; do echo "$P-be$i"; i=$((i + 1)); done
}

down() {
	for ns in $(ip netns list | awk '{print $1}' | grep -E "^$P-(cli|lb|be[0-9]+)\$" || true); do
		ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true
		ip netns del "$ns"
	done
}

up() {
	down
	for ns in $(ns_list); do
		ip netns add "$ns"
		ip -n "$ns" link set lo up
	done
	ip netns exec "$P-lb" sysctl -qw net.ipv4.ip_forward=1 net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.default.rp_filter=0

	ip -n "$P-lb" link add l0 type veth peer name c0 netns "$P-cli"
	ip -n "$P-lb" addr add 172.30.1.1/24 dev l0
	ip -n "$P-cli" addr add 172.30.1.2/24 dev c0
	ip -n "$P-lb" link set l0 up
	ip -n "$P-cli" link set c0 up
	ip -n "$P-cli" route add default via 172.30.1.1

	i=1
	while [ "$i" -le "$N" ]; do
		net=$((10 + i))
		ip -n "$P-lb" link add "b$i" type veth peer name e0 netns "$P-be$i"
		ip -n "$P-lb" addr add "172.30.$net.1/24" dev "b$i"
		ip -n "$P-be$i" addr add "172.30.$net.2/24" dev e0
		ip -n "$P-lb" link set "b$i" up
		ip -n "$P-be$i" link set e0 up
		ip -n "$P-be$i" route add default via "172.30.$net.1"
		ip netns exec "$P-be$i" sysctl -qw net.ipv4.conf.all.rp_filter=0 net.ipv4.conf.e0.rp_filter=0
		if [ "${LAB_PYTHON:-1}" != 0 ] && command -v python3 >/dev/null; then
			ip netns exec "$P-be$i" python3 -m http.server 8080 --bind 0.0.0.0 >/dev/null 2>&1 &
		fi
		i=$((i + 1))
	done
	for dev in $(ip -n "$P-lb" -o link show | awk -F': ' '{print $2}' | cut -d@ -f1); do
		ip netns exec "$P-lb" sysctl -qw "net.ipv4.conf.$dev.rp_filter=0"
	done
	echo "lab up: client $P-cli (172.30.1.2), LB $P-lb, backends $P-be1..$N (172.30.1x.2:8080)"
}

case "${1:-}" in
up) up ;;
down) down ;;
*)
	echo "usage: $0 up [backends] | down" >&2
	exit 2
	;;
esac
