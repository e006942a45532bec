package peerprefill

import (
	"encoding/binary"
	"errors"
	"slices"
	"testing"
	"time"
)

func samplePrefill() Prefill {
	return Prefill{ID: ID{Instance: 7, Seq: 9}, Service: 3, EP: 2, EPHash: EndpointHash("127.0.0.1:8000"),
		Uncached: 3000, TTL: 3 * time.Second, Keys: []uint64{1, 2, 1 << 63}}
}

func TestBeginRoundTrip(t *testing.T) {
	p := samplePrefill()
	d, err := decode(appendBegin(nil, p), nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.kind != kindBegin || d.p.ID != p.ID || d.p.Service != p.Service || d.p.EP != p.EP || d.p.EPHash != p.EPHash ||
		d.p.Uncached != p.Uncached || d.p.TTL != p.TTL || !slices.Equal(d.p.Keys, p.Keys) {
		t.Fatalf("decoded %+v, sent %+v", d.p, p)
	}
	d, err = decode(appendDone(nil, p.ID), nil)
	if err != nil || d.kind != kindDone || d.p.ID != p.ID {
		t.Fatalf("done decoded as %+v, %v", d, err)
	}
}

// An announcement longer than MaxKeys carries its first MaxKeys keys and
// fits MaxDatagram; the TTL is capped at MaxTTL.
func TestBeginIsBounded(t *testing.T) {
	p := samplePrefill()
	p.Keys = make([]uint64, 3*MaxKeys)
	for i := range p.Keys {
		p.Keys[i] = uint64(i + 1)
	}
	p.TTL = time.Hour
	b := appendBegin(nil, p)
	if len(b) != MaxDatagram {
		t.Fatalf("%d bytes, MaxDatagram %d", len(b), MaxDatagram)
	}
	d, err := decode(b, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(d.p.Keys) != MaxKeys || d.p.Keys[MaxKeys-1] != MaxKeys || d.p.TTL != MaxTTL {
		t.Fatalf("%d keys (last %d), ttl %v", len(d.p.Keys), d.p.Keys[len(d.p.Keys)-1], d.p.TTL)
	}
}

func TestDecodeRefusesMalformed(t *testing.T) {
	good := appendBegin(nil, samplePrefill())
	mod := func(f func(b []byte) []byte) []byte { return f(slices.Clone(good)) }
	cases := map[string][]byte{
		"empty":           nil,
		"short header":    good[:headerLen-1],
		"magic":           mod(func(b []byte) []byte { b[0] = 'X'; return b }),
		"version":         mod(func(b []byte) []byte { b[4] = 2; return b }),
		"kind":            mod(func(b []byte) []byte { b[5] = 9; return b }),
		"truncated fixed": good[:headerLen+beginFixed-1],
		"truncated keys":  good[:len(good)-1],
		"trailing":        append(slices.Clone(good), 0),
		"no keys": mod(func(b []byte) []byte {
			binary.BigEndian.PutUint16(b[headerLen+22:], 0)
			return b[:headerLen+beginFixed]
		}),
		"too many keys": mod(func(b []byte) []byte { binary.BigEndian.PutUint16(b[headerLen+22:], MaxKeys+1); return b }),
		"zero ttl":      mod(func(b []byte) []byte { binary.BigEndian.PutUint32(b[headerLen+18:], 0); return b }),
		"long ttl": mod(func(b []byte) []byte {
			binary.BigEndian.PutUint32(b[headerLen+18:], uint32(MaxTTL/time.Millisecond)+1)
			return b
		}),
		"done with body": append(appendDone(nil, ID{1, 2}), 1),
		"instance 0":     appendBegin(nil, Prefill{ID: ID{0, 9}, Service: 3, EP: 2, Uncached: 1, TTL: time.Second, Keys: []uint64{1}}),
		"done of 0":      appendDone(nil, ID{0, 2}),
	}
	for name, b := range cases {
		if _, err := decode(b, nil); !errors.Is(err, errMalformed) {
			t.Errorf("%s: err %v, want errMalformed", name, err)
		}
	}
}

func FuzzDecode(f *testing.F) {
	f.Add(appendBegin(nil, samplePrefill()))
	f.Add(appendDone(nil, ID{1, 2}))
	f.Fuzz(func(t *testing.T, b []byte) {
		d, err := decode(b, make([]uint64, 0, MaxKeys))
		if err != nil {
			return
		}
		if d.p.ID.Instance == 0 {
			t.Fatalf("accepted instance 0: %+v", d)
		}
		if d.kind == kindBegin {
			if len(d.p.Keys) == 0 || len(d.p.Keys) > MaxKeys || d.p.TTL <= 0 || d.p.TTL > MaxTTL {
				t.Fatalf("accepted %+v", d.p)
			}
			// What decodes encodes back to the same bytes.
			if again := appendBegin(nil, d.p); !slices.Equal(again, b) {
				t.Fatalf("re-encoded %x, read %x", again, b)
			}
		}
	})
}
