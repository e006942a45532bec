package gateway

import (
	"strconv"
	"strings"

	"github.com/loxilb-llm/loxilb/pkg/kvevents"
	"github.com/loxilb-llm/loxilb/pkg/selector"
)

// Strict attestation. The KV event plane checks every block that carries
// token ids against the rule's hash contract and gives each endpoint a
// parity verdict. With strict attestation (a rule's kvParityStrict, else
// the daemon's --kv-parity-strict) an endpoint whose verdict is a mismatch
// gets no Tier-1.5 traffic: its inventory does not describe what the
// engine holds, and the speculative entries the gateway adds for the
// endpoint it routes to would otherwise keep "hitting" on it. It still
// serves: the fallback selector may choose it, as for any miss.

// ParityVerdicts reports the endpoints' hash-parity verdicts
// (*kvevents.Manager).
type ParityVerdicts interface {
	// ParityVerdict returns the verdict, "" for an endpoint without a
	// KV-event subscription. Safe for concurrent use; called once per
	// healthy candidate of each tokenized request on strict rules.
	ParityVerdict(service uint32, ep int) string
}

// strict reports whether strict attestation applies to the rule.
func (g *Gateway) strict(st *service) bool {
	if p := st.rule.Service.KVParityStrict; p != nil {
		return *p
	}
	return g.cfg.KVParityStrict
}

// untrustedMask returns the router's ServiceView.Untrusted for one
// decision over cands, counting each endpoint it leaves out.
func (g *Gateway) untrustedMask(st *service, cands []selector.Candidate) uint64 {
	if g.cfg.Parity == nil || st.hasher == nil || !g.strict(st) {
		return 0
	}
	var mask uint64
	for _, c := range cands {
		if !c.Healthy || c.Idx < 0 || c.Idx >= 64 {
			continue
		}
		if v := g.cfg.Parity.ParityVerdict(st.id, c.Idx); kvevents.Untrusted(v) {
			mask |= 1 << uint(c.Idx)
			g.m.untrustedSkipped.WithLabelValues(st.label, strconv.Itoa(c.Idx), v).Inc()
		}
	}
	return mask
}

// KVTrust reports, for read-back, an endpoint's parity verdict ("" when it
// has no KV-event subscription) and whether strict attestation keeps
// Tier-1.5 traffic off it now.
func (g *Gateway) KVTrust(service uint32, ep int) (verdict string, excluded bool) {
	st := g.lookup(service)
	if st == nil || g.cfg.Parity == nil || st.hasher == nil {
		return "", false
	}
	verdict = g.cfg.Parity.ParityVerdict(service, ep)
	return verdict, g.strict(st) && kvevents.Untrusted(verdict)
}

// untrustedField renders the receipt's untrusted= field: the endpoints
// strict attestation kept out of Tier 1.5, "" when none was.
func untrustedField(mask uint64) string {
	if mask == 0 {
		return ""
	}
	var b strings.Builder
	b.WriteString(" untrusted=")
	first := true
	for i := 0; i < 64; i++ {
		if mask&(1<<uint(i)) == 0 {
			continue
		}
		if !first {
			b.WriteByte(',')
		}
		first = false
		b.WriteString(strconv.Itoa(i))
	}
	return b.String()
}
