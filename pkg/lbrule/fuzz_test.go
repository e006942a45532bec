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
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := Decode(body)
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
