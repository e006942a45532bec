package kvevents

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"sync"
	"testing"

	"github.com/loxilb-llm/loxilb/pkg/blockhash"
)

// trtServer emulates trtllm-serve's /server_info and destructive
// /kv_cache_events.
type trtServer struct {
	srv        *httptest.Server
	mu         sync.Mutex
	serverInfo string // "" -> 404
	queue      [][]byte
	drains     int
	nodes      map[string]int // drains by the NodeHeader they carried
	wrongVerb  int
	failDrains bool // answer drains with HTTP 500
}

func newTRTServer(t *testing.T, serverInfo string) *trtServer {
	ts := &trtServer{serverInfo: serverInfo}
	mux := http.NewServeMux()
	mux.HandleFunc("/server_info", func(w http.ResponseWriter, r *http.Request) {
		ts.mu.Lock()
		defer ts.mu.Unlock()
		if ts.serverInfo == "" {
			http.NotFound(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprint(w, ts.serverInfo)
	})
	mux.HandleFunc("/kv_cache_events", func(w http.ResponseWriter, r *http.Request) {
		ts.mu.Lock()
		defer ts.mu.Unlock()
		if r.Method != http.MethodPost {
			ts.wrongVerb++
			w.WriteHeader(http.StatusMethodNotAllowed)
			return
		}
		ts.drains++
		if ts.nodes == nil {
			ts.nodes = make(map[string]int)
		}
		ts.nodes[r.Header.Get(NodeHeader)]++
		if ts.failDrains {
			w.WriteHeader(http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		if len(ts.queue) == 0 {
			fmt.Fprint(w, "[]")
			return
		}
		w.Write(ts.queue[0])
		ts.queue = ts.queue[1:]
	})
	ts.srv = httptest.NewServer(mux)
	t.Cleanup(ts.srv.Close)
	return ts
}

func (ts *trtServer) push(body string) {
	ts.mu.Lock()
	ts.queue = append(ts.queue, []byte(body))
	ts.mu.Unlock()
}

func (ts *trtServer) pending() int {
	ts.mu.Lock()
	defer ts.mu.Unlock()
	return len(ts.queue)
}

func (ts *trtServer) port(t *testing.T) int {
	_, p, _ := net.SplitHostPort(ts.srv.Listener.Addr().String())
	n, err := strconv.Atoi(p)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

func trtSpec(port, bs int) Spec {
	return Spec{Service: 4, EPIdx: 1, Engine: EngineTRTLLM, Host: "127.0.0.1", TargetPort: port, BlockSize: bs}
}

func seqTokens(from, n int) []uint32 {
	out := make([]uint32, n)
	for i := range out {
		out[i] = uint32(from + i)
	}
	return out
}

func tokensJSON(from, n int) string {
	s := "["
	for i := 0; i < n; i++ {
		if i > 0 {
			s += ","
		}
		s += fmt.Sprintf(`{"type":"unique_token","token_id":%d,"token_extra_id":0}`, from+i)
	}
	return s + "]"
}

func TestTRTLLMDrainVector(t *testing.T) {
	ts := newTRTServer(t, `{"disaggregated_params":{}}`)
	ts.push(string(loadTRTBody(t)))
	h := startManager(t, fastConfig(), trtSpec(ts.port(t), 32))

	bh, err := blockhash.New(blockhash.Config{Algo: blockhash.BlockHashTRTLLM, BlockSize: 32})
	if err != nil {
		t.Fatal(err)
	}
	d1, k1 := bh.Next(blockhash.Digest{}, seqTokens(1, 32))
	_, k2 := bh.Next(d1, seqTokens(33, 32))
	waitFor(t, "vector drained", func() bool { return ts.pending() == 0 && h.status(4, 1).Ranks[0].LastSeq == 3 })
	if got := h.sink.keys(4, 1, 0); !slices.Equal(got, []uint64{k1}) {
		t.Fatalf("inventory = %v, want [%d] (k2 %d removed)", got, k1, k2)
	}
	st := h.status(4, 1)
	if st.Admission == nil || st.Admission.Verdict != AdmissionLegacy || st.Parity.Verdict != VerdictOK || !st.Connected {
		t.Fatalf("status = %+v adm %+v", st, st.Admission)
	}
	if st.BlocksStored != 2 || st.BlocksRemoved != 1 {
		t.Fatalf("counts = %+v", st)
	}

	// A child of the surviving block, a child of the removed one (unknown
	// parent: skipped), then event ids jump (another reader drained some).
	ts.push(fmt.Sprintf(`[{"event_id":4,"window_size":4096,"data":{"type":"stored","parent_hash":13373336404899918911,
	  "blocks":[{"type":"stored_block","block_hash":77,"tokens":%s,"cache_level":0,"priority":35}]}},
	 {"event_id":5,"window_size":4096,"data":{"type":"stored","parent_hash":15666736886184129505,
	  "blocks":[{"type":"stored_block","block_hash":78,"tokens":%s,"cache_level":0,"priority":35}]}},
	 {"event_id":9,"window_size":4096,"data":{"type":"removed","block_hashes":[13373336404899918911]}}]`,
		tokensJSON(65, 32), tokensJSON(97, 32)))
	_, k3 := bh.Next(d1, seqTokens(65, 32))
	waitFor(t, "second drain", func() bool { return h.status(4, 1).Ranks[0].LastSeq == 9 })
	if got := h.sink.keys(4, 1, 0); !slices.Equal(got, []uint64{k3}) {
		t.Fatalf("inventory = %v, want [%d]", got, k3)
	}
	st = h.status(4, 1)
	if st.Gaps != 1 || !st.Degraded || st.EventsSkipped != 1 {
		t.Fatalf("status = %+v", st)
	}
	ts.mu.Lock()
	wrong := ts.wrongVerb
	ts.mu.Unlock()
	if wrong != 0 {
		t.Fatal("drain used a verb other than POST")
	}
}

func TestTRTLLMAdmission(t *testing.T) {
	ts := newTRTServer(t, `{"kv_cache_config":{"tokens_per_block":16}}`)
	ts.push(string(loadTRTBody(t)))
	h := startManager(t, fastConfig(), trtSpec(ts.port(t), 32))
	waitFor(t, "refusal", func() bool {
		a := h.status(4, 1).Admission
		return a != nil && a.Verdict == AdmissionRefused
	})
	if ts.pending() != 1 {
		t.Fatal("a refused endpoint was drained")
	}
	if h.metric("loxilb_kv_trtllm_admission", map[string]string{"ep_idx": "1", "verdict": AdmissionRefused}) != 1 {
		t.Fatal("admission metric")
	}
	// The engine is relaunched with the rule's geometry: admitted on recheck.
	ts.mu.Lock()
	ts.serverInfo = `{"kv_cache_hash_algo":"v1_block_key","tokens_per_block":32}`
	ts.mu.Unlock()
	waitFor(t, "admission", func() bool { return h.status(4, 1).Admission.Verdict == AdmissionAdmitted })
	waitFor(t, "drain", func() bool { return ts.pending() == 0 && len(h.sink.keys(4, 1, 0)) == 1 })

	ts2 := newTRTServer(t, `{"kv_cache_hash_algo":"v2_sha256"}`)
	h.m.mu.Lock()
	sub := h.m.subs[subKey{4, 1}]
	h.m.mu.Unlock()
	if a := sub.checkServerInfoFor(t, ts2); a.Verdict != AdmissionRefused {
		t.Fatalf("v2_sha256 admission = %+v", a)
	}
}

// checkServerInfoFor runs one admission check against another server.
func (s *subscription) checkServerInfoFor(t *testing.T, ts *trtServer) Admission {
	spec := s.spec
	spec.TargetPort = ts.port(t)
	c := newSubscription(s.m, spec)
	defer c.met.delete()
	return c.checkServerInfo(t.Context())
}

func TestTRTLLMBlockSizeMismatch(t *testing.T) {
	ts := newTRTServer(t, "")
	ts.push(string(loadTRTBody(t)))
	h := startManager(t, fastConfig(), trtSpec(ts.port(t), 16))
	waitFor(t, "verdict", func() bool { return h.status(4, 1).Parity.Verdict == VerdictBlockSizeMismatch })
	if got := h.sink.keys(4, 1, -1); len(got) != 0 {
		t.Fatalf("inventory = %v", got)
	}
}

func TestTRTLLMErrorsAndRestart(t *testing.T) {
	ts := newTRTServer(t, "")
	ts.failDrains = true
	ts.push(string(loadTRTBody(t)))
	h := startManager(t, fastConfig(), trtSpec(ts.port(t), 32))
	waitFor(t, "recv errors", func() bool { return h.status(4, 1).RecvErrors >= 2 })
	if h.status(4, 1).Connected {
		t.Fatal("connected while drains fail")
	}
	ts.mu.Lock()
	ts.failDrains = false
	ts.mu.Unlock()
	waitFor(t, "drained", func() bool { return h.status(4, 1).Ranks[0].LastSeq == 3 && h.status(4, 1).Connected })
	if len(h.sink.keys(4, 1, 0)) != 1 {
		t.Fatal("vector not applied")
	}
	// The engine restarts: event ids start over with "created".
	ts.push(`[{"event_id":0,"window_size":4096,"data":{"type":"created","num_blocks_per_cache_level":[4096,0]}},
	 {"event_id":1,"window_size":4096,"data":{"type":"stored","parent_hash":null,"blocks":[{"type":"stored_block","block_hash":5,"tokens":` + tokensJSON(500, 32) + `}]}}]`)
	bh, _ := blockhash.New(blockhash.Config{Algo: blockhash.BlockHashTRTLLM, BlockSize: 32})
	_, k := bh.Next(blockhash.Digest{}, seqTokens(500, 32))
	waitFor(t, "restart applied", func() bool { return slices.Equal(h.sink.keys(4, 1, 0), []uint64{k}) })
	if st := h.status(4, 1); st.Resets < 2 || st.Degraded {
		t.Fatalf("status = %+v", st)
	}
}
