package kvevents

import (
	"encoding/hex"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"
)

const vectorsDir = "../../testdata/vectors"

type zmqFrames struct {
	TopicHex   string `json:"topic_hex"`
	SeqHex     string `json:"seq_hex"`
	PayloadHex string `json:"payload_hex"`
}

type eventVector struct {
	Name      string          `json:"name"`
	Decoded   json.RawMessage `json:"decoded"`
	ZMQFrames *zmqFrames      `json:"zmq_frames"`
}

type eventVectorFile struct {
	Vectors []eventVector `json:"vectors"`
}

// frames returns the three ZMQ frames of a vector.
func (v eventVector) frames(t testing.TB) (topic, seq, payload []byte) {
	t.Helper()
	var err error
	if topic, err = hex.DecodeString(v.ZMQFrames.TopicHex); err != nil {
		t.Fatal(err)
	}
	if seq, err = hex.DecodeString(v.ZMQFrames.SeqHex); err != nil {
		t.Fatal(err)
	}
	if payload, err = hex.DecodeString(v.ZMQFrames.PayloadHex); err != nil {
		t.Fatal(err)
	}
	return topic, seq, payload
}

func loadEventVectors(t testing.TB, file string) map[string]eventVector {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(vectorsDir, file))
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	var f eventVectorFile
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatalf("parse %s: %v", file, err)
	}
	out := make(map[string]eventVector)
	for _, v := range f.Vectors {
		if v.ZMQFrames != nil {
			out[v.Name] = v
		}
	}
	return out
}

func loadTRTBody(t testing.TB) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(vectorsDir, "trtllm_event_vectors.json"))
	if err != nil {
		t.Fatalf("read vectors: %v", err)
	}
	var f struct {
		SampleBody json.RawMessage `json:"sample_body"`
	}
	if err := json.Unmarshal(b, &f); err != nil {
		t.Fatal(err)
	}
	return f.SampleBody
}
