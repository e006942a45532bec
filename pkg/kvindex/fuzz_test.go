package kvindex

import "testing"

// FuzzOps decodes arbitrary bytes into inventory operations and checks the
// index against the reference model after each one.
func FuzzOps(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})
	f.Add([]byte{0x00, 0x11, 0x22, 0x40, 0x81, 0xc2, 0xe3, 0xff, 0x10})
	f.Fuzz(func(t *testing.T, data []byte) {
		ix, err := New(Config{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		ref := model{}
		for len(data) >= 2 {
			b0, b1 := data[0], data[1]
			data = data[2:]
			ep, rank := int(b0&3), int(b0>>2&3)
			ks := []uint64{uint64(b1 & 15), uint64(b1 >> 4)}
			m := ref.ep(0, ep)
			switch b0 >> 4 & 7 {
			case 0, 1, 2:
				ix.Store(0, ep, rank, ks)
				for _, k := range ks {
					m[k] |= 1 << rank
				}
			case 3, 4:
				ix.Remove(0, ep, rank, ks)
				for _, k := range ks {
					if m[k]&(1<<rank) != 0 {
						if m[k] &^= 1 << rank; m[k] == 0 {
							delete(m, k)
						}
					}
				}
			case 5:
				ix.ClearRank(0, ep, rank)
				for k := range m {
					if m[k] &^= 1 << rank; m[k] == 0 {
						delete(m, k)
					}
				}
			case 6:
				ix.ClearEndpoint(0, ep)
				clear(m)
			case 7:
				ix.DropService(0)
				delete(ref, 0)
			}
			q := []uint64{uint64(b1 & 15), uint64(b1 >> 4), uint64(b0 & 15)}
			got := match(ix, 0, q, 0, 1, 2, 3)
			for e := 0; e < 4; e++ {
				want := 0
				for _, k := range q {
					if _, ok := ref.ep(0, e)[k]; !ok {
						break
					}
					want++
				}
				if got[e] != want || ix.Len(0, e) != len(ref.ep(0, e)) {
					t.Fatalf("ep %d: match %d want %d, len %d want %d", e, got[e], want, ix.Len(0, e), len(ref.ep(0, e)))
				}
			}
		}
		checkInvariants(t, ix)
	})
}
