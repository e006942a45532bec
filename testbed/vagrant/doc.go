// Package vagrant holds the lab VM's scripts, which the Vagrantfile calls:
// provision.sh (packages, Go, the BPF objects' freshness report, binaries)
// and lab.sh (up, check, down, test: the testbed/netns topology with the
// daemon and a mode-0 and a mode-4 rule). Its tests check what can be
// checked without a hypervisor: the Vagrantfile's and the scripts' syntax,
// and lab.sh run as a plain script on this machine (root, CI=true).
package vagrant
