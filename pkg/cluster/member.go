package cluster

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"
)

// Member is what one node announces about itself.
type Member struct {
	// Name identifies the node (--node-name); it is the key of its record.
	Name string `json:"name"`
	// Address is the node's advertised management API address (host:port).
	Address string `json:"address"`
	// Peer is the UDP address (host:port) of the node's prefill
	// announcements (pkg/peerprefill); empty when it sends none (cluster
	// routing off).
	Peer string `json:"peer,omitempty"`
	// Version is the product version the node runs.
	Version string `json:"version"`
	// Started is when the node's process started.
	Started time.Time `json:"started"`
	// Settings are the parity-relevant settings by name (SettingSeed,
	// TokenizerPrefix+model, environment variable names): values compared
	// across nodes, never secrets.
	Settings map[string]string `json:"settings"`
}

// Setting names that are not environment variables.
const (
	// SettingSeed is the fingerprint of LLB_KV_NONE_HASH_SEED.
	SettingSeed = "seed_fingerprint"
	// TokenizerPrefix + a served model name is the checksum of the
	// model's staged tokenizer files.
	TokenizerPrefix = "tokenizer/"
)

// Limits of a member record: a record another writer made larger or
// stranger is reported as invalid, never decoded without bound.
const (
	MaxNameLen      = 63
	MaxRecordBytes  = 64 << 10
	MaxSettings     = 512
	maxSettingBytes = 256
)

// ErrInvalidRecord marks a member record that does not decode or breaks a
// limit.
var ErrInvalidRecord = errors.New("invalid member record")

// ValidName reports whether name can name a node: 1..63 of [A-Za-z0-9._-],
// starting with a letter or digit (it is an etcd key segment and a column
// of loxicmd's table).
func ValidName(name string) error {
	if name == "" || len(name) > MaxNameLen {
		return fmt.Errorf("node name %q: want 1..%d characters", name, MaxNameLen)
	}
	for i, c := range name {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || i > 0 && (c == '.' || c == '_' || c == '-')
		if !ok {
			return fmt.Errorf("node name %q: want letters, digits, '.', '_' or '-', starting with a letter or digit", name)
		}
	}
	return nil
}

// Encode is the stored form of a member.
func (m Member) Encode() ([]byte, error) {
	if err := m.check(); err != nil {
		return nil, err
	}
	return json.Marshal(m)
}

// Decode reads a stored member whose record key names it name.
func Decode(name string, b []byte) (Member, error) {
	var m Member
	if len(b) > MaxRecordBytes {
		return m, fmt.Errorf("%w: node %q: %d bytes, limit %d", ErrInvalidRecord, name, len(b), MaxRecordBytes)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return Member{}, fmt.Errorf("%w: node %q: %v", ErrInvalidRecord, name, err)
	}
	if m.Name != name {
		return Member{}, fmt.Errorf("%w: record of node %q names %q", ErrInvalidRecord, name, m.Name)
	}
	if err := m.check(); err != nil {
		return Member{}, err
	}
	return m, nil
}

func (m Member) check() error {
	if err := ValidName(m.Name); err != nil {
		return fmt.Errorf("%w: %v", ErrInvalidRecord, err)
	}
	if len(m.Settings) > MaxSettings {
		return fmt.Errorf("%w: node %q: %d settings, limit %d", ErrInvalidRecord, m.Name, len(m.Settings), MaxSettings)
	}
	for k, v := range m.Settings {
		if k == "" || len(k) > maxSettingBytes || len(v) > maxSettingBytes {
			return fmt.Errorf("%w: node %q: setting %.40q: name and value must be 1..%d bytes", ErrInvalidRecord, m.Name, k, maxSettingBytes)
		}
	}
	if len(m.Address) > maxSettingBytes || len(m.Version) > maxSettingBytes || len(m.Peer) > maxSettingBytes {
		return fmt.Errorf("%w: node %q: address, peer address or version over %d bytes", ErrInvalidRecord, m.Name, maxSettingBytes)
	}
	return nil
}

// NodeValue is one node's value of a drifting setting; Value "" means
// the node does not have the setting (a tokenizer not staged there).
type NodeValue struct {
	Node  string `json:"node"`
	Value string `json:"value"`
}

// Drift is one setting whose value differs between nodes.
type Drift struct {
	Setting string      `json:"setting"`
	Values  []NodeValue `json:"values"`
	// Drifting are the nodes away from the value most nodes hold; when no
	// value is held by more nodes than every other, every node is.
	Drifting []string `json:"drifting"`
}

// ComputeDrift compares the settings of every member: a setting is
// drifting when two members hold different values, a member without it
// counting as holding "". The result is ordered by setting name, its
// values by node name.
func ComputeDrift(members []Member) []Drift {
	if len(members) < 2 {
		return nil
	}
	names := map[string]bool{}
	for _, m := range members {
		for k := range m.Settings {
			names[k] = true
		}
	}
	var out []Drift
	for k := range names {
		count := map[string]int{}
		vals := make([]NodeValue, 0, len(members))
		for _, m := range members {
			v := m.Settings[k]
			count[v]++
			vals = append(vals, NodeValue{Node: m.Name, Value: v})
		}
		if len(count) < 2 {
			continue
		}
		sort.Slice(vals, func(i, j int) bool { return vals[i].Node < vals[j].Node })
		best, bestN, tie := "", -1, false
		for v, n := range count {
			if n > bestN {
				best, bestN, tie = v, n, false
			} else if n == bestN {
				tie = true
			}
		}
		d := Drift{Setting: k, Values: vals}
		for _, nv := range vals {
			if tie || nv.Value != best {
				d.Drifting = append(d.Drifting, nv.Node)
			}
		}
		out = append(out, d)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Setting < out[j].Setting })
	return out
}

// DriftOf lists the settings on which node drifts, as a sentence naming
// its value and the others' (for the capability's reason).
func DriftOf(node string, drift []Drift) []string {
	var out []string
	for _, d := range drift {
		for _, n := range d.Drifting {
			if n != node {
				continue
			}
			var parts []string
			for _, nv := range d.Values {
				parts = append(parts, nv.Node+"="+Shown(nv.Value))
			}
			out = append(out, d.Setting+" differs ("+strings.Join(parts, ", ")+")")
		}
	}
	return out
}

// Shown is a setting value as tables print it: "(unset)" for a node
// without the setting.
func Shown(v string) string {
	if v == "" {
		return "(unset)"
	}
	return v
}

// NameFromHost turns a host name into a valid node name (the default of
// --node-name): characters a name cannot hold become '-', and the name is
// cut to MaxNameLen; an empty or unusable host name gives "node".
func NameFromHost(host string) string {
	b := []byte(host)
	for i, c := range b {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			b[i] = '-'
		}
	}
	s := strings.TrimLeft(string(b), "._-")
	if len(s) > MaxNameLen {
		s = s[:MaxNameLen]
	}
	if s == "" {
		return "node"
	}
	return s
}
