package store

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
)

// FuzzVerifyBoltFile: no file content makes the verifier panic, loop or
// allocate beyond the file's own size, and every refusal is a reason.
func FuzzVerifyBoltFile(f *testing.F) {
	dir := f.TempDir()
	s, err := OpenBolt(dir)
	if err != nil {
		f.Fatal(err)
	}
	for i := 0; i < 3; i++ {
		id, _ := s.NextID()
		_ = s.Put(Record{ID: id, Rule: json.RawMessage(`{"r":1}`), CreateBody: json.RawMessage(`{}`)})
	}
	s.Close()
	b, err := os.ReadFile(filepath.Join(dir, "rules.db"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add([]byte{})
	f.Add(b[:100])
	f.Fuzz(func(t *testing.T, data []byte) {
		err := verifyBoltFile(bytes.NewReader(data), int64(len(data)))
		if err == nil {
			return
		}
		var ve *verifyError
		if !errors.As(err, &ve) {
			t.Fatalf("unclassified error %T: %v", err, err)
		}
	})
}
