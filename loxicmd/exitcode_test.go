package main

import (
	"fmt"
	"testing"

	"github.com/loxilb-llm/loxilb/api/client"
)

// TestExitCodeOfLimits: a body the daemon refuses as too large is invalid
// input (6); a body it cut for slowness is worth a retry (5).
func TestExitCodeOfLimits(t *testing.T) {
	for status, want := range map[int]int{413: exitInvalid, 408: exitUnavailable, 409: exitPrecondition, 412: exitPrecondition, 500: exitFailed} {
		if got := exitCode(&client.APIError{Status: status}); got != want {
			t.Errorf("status %d: exit %d, want %d", status, got, want)
		}
	}
}

// TestExitCodeOfDrift: drift between nodes exits as a failed diagnostics
// check does, so one gate covers both.
func TestExitCodeOfDrift(t *testing.T) {
	if got := exitCode(fmt.Errorf("%w (1 setting(s))", errDrift)); got != exitCheckFailed {
		t.Fatalf("exit %d, want %d", got, exitCheckFailed)
	}
}
