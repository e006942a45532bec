package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"time"

	"github.com/loxilb-llm/loxilb/api"
	"github.com/loxilb-llm/loxilb/pkg/cluster"
	"github.com/loxilb-llm/loxilb/pkg/store"
)

// clusterFlags name this node among the nodes sharing a store.
type clusterFlags struct {
	name    string
	address string // the advertised API address (--advertise-addr), resolved by validate
	ttl     time.Duration
	// peerPort is the UDP port of prefill announcements (0: any free port).
	peerPort int
}

// defaultNodeName is the host name, adapted to a valid node name.
func defaultNodeName() string {
	host, _ := os.Hostname()
	return cluster.NameFromHost(host)
}

// validate checks the flags and resolves the address this node announces:
// advertise (--advertise-addr, the one address other nodes reach this
// node's API at, for membership and the TensorRT-LLM relay alike) or else
// --api-addr, with the node name for an unspecified host.
func (c *clusterFlags) validate(apiAddr, advertise string) error {
	c.address = advertise
	if err := cluster.ValidName(c.name); err != nil {
		return fmt.Errorf("--node-name: %w (set --node-name when the host name does not fit)", err)
	}
	if c.ttl < cluster.MinTTL || c.ttl > cluster.MaxTTL || c.ttl%time.Second != 0 {
		return fmt.Errorf("--cluster-ttl %v: want whole seconds within %v..%v", c.ttl, cluster.MinTTL, cluster.MaxTTL)
	}
	if c.address == "" {
		host, port, err := net.SplitHostPort(apiAddr)
		if err != nil {
			return fmt.Errorf("--api-addr %q: %w", apiAddr, err)
		}
		if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
			host = c.name
		}
		c.address = net.JoinHostPort(host, port)
	}
	if _, _, err := net.SplitHostPort(c.address); err != nil || len(c.address) > 253 {
		return fmt.Errorf("--advertise-addr %q: want host:port", c.address)
	}
	return nil
}

// peerListen is the UDP address prefill announcements are taken at: the
// advertised host when it is an IP address (so they are taken only where
// the other nodes reach this one), else every address, at --cluster-peer-port.
func (c *clusterFlags) peerListen() string {
	host, _, _ := net.SplitHostPort(c.address)
	if net.ParseIP(host) == nil {
		host = ""
	}
	return net.JoinHostPort(host, strconv.Itoa(c.peerPort))
}

// peerAdvertised is the address the other nodes send announcements to:
// the advertised host and the port bound.
func (c *clusterFlags) peerAdvertised(port uint16) string {
	host, _, _ := net.SplitHostPort(c.address)
	return net.JoinHostPort(host, strconv.Itoa(int(port)))
}

// etcdMembers adapts the etcd store's leases to cluster.Backend.
type etcdMembers struct{ e *store.Etcd }

func (m etcdMembers) Register(ctx context.Context, name string, v []byte, ttl time.Duration) (cluster.Registration, error) {
	l, err := m.e.Register(ctx, name, v, ttl)
	if err != nil {
		return nil, err
	}
	return l, nil
}

func (m etcdMembers) Members(ctx context.Context) (map[string][]byte, error) { return m.e.Members(ctx) }

// localSettings are what this node announces: the seed's fingerprint (fp,
// cluster.SeedFingerprint),
// the staged tokenizers' checksums and the routing settings (routing
// holds the router's and gateway's effective values by variable name).
func localSettings(fp string, tokens *cluster.Tokenizers, routing map[string]string) func() map[string]string {
	return func() map[string]string {
		out := tokens.Settings()
		out[cluster.SettingSeed] = fp
		for k, v := range routing {
			out[k] = v
		}
		return out
	}
}

// clusterCap is the "cluster" capability: degraded while this node's
// settings drift from the others', with the settings and values.
func clusterCap(v cluster.View) api.Capability {
	c := api.Capability{Name: "cluster", Ready: true,
		Reason: v.Backend + ", " + strconv.Itoa(len(v.Nodes)) + " node(s), this node " + v.Self}
	if deg, why := v.Degraded(); deg {
		c.Ready, c.ReasonCode, c.Reason = false, cluster.StateDegraded, why
	} else if !v.Registered {
		c.Ready, c.ReasonCode, c.Reason = false, "not_registered", v.Reason
	}
	return c
}
