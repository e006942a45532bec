package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"testing"
)

func TestRunPrintsReadyAndServes(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	pr, pw := io.Pipe()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, []string{"--engine", "sglang", "--listen", "127.0.0.1:0", "--zmq-port", "0",
			"--dp-ranks", "2", "--role", "prefill", "--bootstrap-port", "0", "--time-scale", "0"}, pw, io.Discard)
		pw.Close()
	}()
	line, err := bufio.NewReader(pr).ReadBytes('\n')
	if err != nil {
		t.Fatalf("ready line: %v", err)
	}
	var r Ready
	if err := json.Unmarshal(line, &r); err != nil || !r.Ready || len(r.ZMQPorts) != 2 || r.BootstrapPort == 0 {
		t.Fatalf("ready %s (%v)", line, err)
	}
	resp, err := http.Get("http://" + r.HTTP + "/get_server_info")
	if err != nil || resp.StatusCode != 200 {
		t.Fatalf("server info: %v", err)
	}
	resp.Body.Close()
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
}

func TestRunRejectsBadFlags(t *testing.T) {
	for _, args := range [][]string{{"--engine", "nope"}, {"--block-size", "-1"}, {"extra"}, {"--log-level", "loud"}} {
		if err := run(context.Background(), append(args, "--listen", "127.0.0.1:0", "--zmq-port", "0"), io.Discard, io.Discard); err == nil {
			t.Errorf("%v accepted", args)
		}
	}
}
