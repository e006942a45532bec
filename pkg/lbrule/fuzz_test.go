package lbrule

import (
	"errors"
	"os"
	"testing"
)

// FuzzDecodePrepare checks that no body makes the decoder or validator panic,
// and that every failure is a classified RuleError (so the API never answers 500).
func FuzzDecodePrepare(f *testing.F) {
	for _, p := range []string{"testdata/seed_sglang_single.json", "testdata/seed_vllm_pd.json", "testdata/seed_sglang_ranks.json"} {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte(`{"serviceArguments":{"externalIP":"::1","port":1,"protocol":"tcp","mode":3,"sel":1},"endpoints":[{"endpointIP":"::2","targetPort":1}]}`))
	f.Add([]byte(`{"serviceArguments":{"externalIP":"::ffff:127.0.0.1","port":1,"port":2,"protocol":"tcp","mode":4},"endpoints":[{"endpointIP":"::ffff:127.0.0.2","targetPort":1}]}`))
	f.Add([]byte(`{"ServiceArguments":{"EXTERNALIP":"127.0.0.1","kvexactmode":3,"PD_DISAGG_MODE":true},"Endpoints":[{"EndpointIP":"127.0.0.2","Ep_Role":1}]}`))
	f.Add([]byte(`{"serviceArguments":{"name":"a/b\u0000","probetype":"http","probereq":"GET / HTTP/1.1","probeTimeout":99999999999}}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := Decode(body)
		if err == nil {
			// What the daemon stores and echoes decodes again: its keys
			// are loxilb's, exactly as written, each once.
			b, eerr := Encode(r)
			if eerr != nil {
				t.Fatal(eerr)
			}
			if _, derr := Decode(b); derr != nil {
				t.Fatalf("re-encoded rule rejected: %v\n%s", derr, b)
			}
		}
		if err != nil {
			var re *RuleError
			if !errors.As(err, &re) {
				t.Fatalf("unclassified decode error %T: %v", err, err)
			}
			return
		}
		_, err = Prepare(r, seeded)
		if err != nil {
			var re *RuleError
			if !errors.As(err, &re) || re.Class == nil {
				t.Fatalf("unclassified validation error %T: %v", err, err)
			}
		}
	})
}
