package router

import (
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
)

// HeaderName is the response header that carries a Receipt when the client
// asks for one.
const HeaderName = "X-Loxilb-Route"

// Receipt explains one routing decision: which tier routed the request,
// where it went, how much of its prefix that endpoint had cached, and why.
type Receipt struct {
	Tier    string
	EP      int // -1 when no endpoint could be chosen
	Matched int // consecutive prefix blocks cached on EP
	Total   int // full blocks in the request
	From    int // the endpoint a spill or seed moved the request away from; -1 otherwise
	Reason  string
	// Rank is the data-parallel rank of EP the request was sent to, when
	// RankSet: the engine was told to serve it there.
	Rank    int
	RankSet bool
}

// String formats the receipt as the header value, e.g.
//
//	tier=tier1.5 ep=2 matched=12/16 reason=longest_prefix
//	tier=spill ep=0 matched=0/16 from=2 reason=over_cap
//	tier=tier1.5 ep=1 rank=1 matched=8/9 reason=longest_prefix
func (r Receipt) String() string {
	var b strings.Builder
	b.Grow(64)
	b.WriteString("tier=")
	b.WriteString(r.Tier)
	b.WriteString(" ep=")
	b.WriteString(strconv.Itoa(r.EP))
	if r.RankSet {
		b.WriteString(" rank=")
		b.WriteString(strconv.Itoa(r.Rank))
	}
	b.WriteString(" matched=")
	b.WriteString(strconv.Itoa(r.Matched))
	b.WriteByte('/')
	b.WriteString(strconv.Itoa(r.Total))
	if r.From >= 0 {
		b.WriteString(" from=")
		b.WriteString(strconv.Itoa(r.From))
	}
	b.WriteString(" reason=")
	b.WriteString(r.Reason)
	return b.String()
}

// LogValue renders the receipt as structured log attributes.
func (r Receipt) LogValue() slog.Value {
	attrs := []slog.Attr{
		slog.String("tier", r.Tier),
		slog.Int("ep", r.EP),
		slog.Int("matched_blocks", r.Matched),
		slog.Int("total_blocks", r.Total),
	}
	if r.From >= 0 {
		attrs = append(attrs, slog.Int("from", r.From))
	}
	return slog.GroupValue(append(attrs, slog.String("reason", r.Reason))...)
}

var errReceipt = errors.New("malformed route receipt")

// ParseReceipt parses a header value produced by Receipt.String. Tests and
// tools use it to assert on routing without scraping logs.
func ParseReceipt(s string) (Receipt, error) {
	r := Receipt{EP: -1, From: -1}
	seen := 0
	for _, field := range strings.Fields(s) {
		k, v, ok := strings.Cut(field, "=")
		if !ok {
			return Receipt{}, fmt.Errorf("%w: field %q has no '='", errReceipt, field)
		}
		var err error
		switch k {
		case "tier":
			r.Tier = v
			seen |= 1
		case "ep":
			r.EP, err = strconv.Atoi(v)
			seen |= 2
		case "matched":
			m, t, ok := strings.Cut(v, "/")
			if !ok {
				return Receipt{}, fmt.Errorf("%w: matched=%q, want M/T", errReceipt, v)
			}
			if r.Matched, err = strconv.Atoi(m); err == nil {
				r.Total, err = strconv.Atoi(t)
			}
			seen |= 4
		case "from":
			r.From, err = strconv.Atoi(v)
		case "rank":
			r.Rank, err = strconv.Atoi(v)
			r.RankSet = err == nil
		case "reason":
			r.Reason = v
			seen |= 8
		default:
			// Unknown fields are ignored so the format can grow.
		}
		if err != nil {
			return Receipt{}, fmt.Errorf("%w: %s=%q: %v", errReceipt, k, v, err)
		}
	}
	if seen != 15 {
		return Receipt{}, fmt.Errorf("%w: %q lacks tier, ep, matched or reason", errReceipt, s)
	}
	return r, nil
}
