package enginesim

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"time"
)

// Faults are the injectable failures. They are set by flags at start and
// changed at run time with POST /sim/fault; a JSON body replaces only the
// fields it names. Counters ("next N") count down as they fire.
type Faults struct {
	// DropBatches drops the next N event batches (ZMQ: the sequence number
	// is consumed, leaving a gap that replay can repair; TRT-LLM: the
	// events never reach the queue, leaving an event_id gap).
	DropBatches int `json:"drop_batches"`
	// DropProb drops each event batch with this probability.
	DropProb float64 `json:"drop_prob"`
	// ReorderBatches swaps each of the next N batches with the batch after it.
	ReorderBatches int `json:"reorder_batches"`
	// ReorderHoldMs bounds how long a held batch waits for a successor
	// before it is sent anyway (default 200), so reordering never becomes loss.
	ReorderHoldMs int `json:"reorder_hold_ms"`
	// EventDelayMs delays every event batch by this many milliseconds.
	EventDelayMs int `json:"event_delay_ms"`
	// StallMs holds every inference request this long before serving it.
	StallMs int `json:"stall_ms"`
	// FailRequests answers the next N inference requests with FailStatus;
	// a negative value fails all of them until cleared.
	FailRequests int `json:"fail_requests"`
	// FailStatus is the status of injected failures (default 500).
	FailStatus int `json:"fail_status"`
	// CloseMidStream cuts the connection of the next N responses halfway
	// through the output (a non-streaming response is cut before the body).
	CloseMidStream int `json:"close_mid_stream"`
	// ResetRequests reads the next N inference requests whole and then
	// resets their connection (TCP RST) without answering: an engine that
	// may have started the request and crashed. Negative: all of them.
	ResetRequests int `json:"reset_requests"`
	// HealthFail makes /health answer 503.
	HealthFail bool `json:"health_fail"`
}

// FaultRequest is the body of POST /sim/fault: the fault fields plus two
// actions. Clear resets every fault first; Restart emulates an engine
// restart (cache cleared, event sequence reset to 0, AllBlocksCleared
// published; TRT-LLM: event queue emptied, event_id reset, "created" queued).
type FaultRequest struct {
	Faults
	Clear   bool `json:"clear"`
	Restart bool `json:"restart"`
}

func (f *Faults) validate() error {
	if f.DropProb < 0 || f.DropProb > 1 {
		return fmt.Errorf("drop_prob %v: must be within [0, 1]", f.DropProb)
	}
	if f.FailStatus != 0 && (f.FailStatus < 400 || f.FailStatus > 599) {
		return fmt.Errorf("fail_status %d: must be a 4xx or 5xx status", f.FailStatus)
	}
	if f.DropBatches < 0 || f.ReorderBatches < 0 || f.ReorderHoldMs < 0 || f.EventDelayMs < 0 || f.StallMs < 0 || f.CloseMidStream < 0 {
		return fmt.Errorf("drop_batches, reorder_batches, reorder_hold_ms, event_delay_ms, stall_ms and close_mid_stream must not be negative")
	}
	return nil
}

type faultState struct {
	mu sync.Mutex
	f  Faults
}

func (s *faultState) get() Faults {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.f
}

func (s *faultState) set(f Faults) {
	s.mu.Lock()
	s.f = f
	s.mu.Unlock()
}

type batchAction struct {
	drop, reorder bool
	delay, hold   time.Duration
}

func (s *faultState) batchAction(rng *rand.Rand) batchAction {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := batchAction{delay: time.Duration(s.f.EventDelayMs) * time.Millisecond}
	switch {
	case s.f.DropBatches > 0:
		s.f.DropBatches--
		a.drop = true
	case s.f.DropProb > 0 && rng.Float64() < s.f.DropProb:
		a.drop = true
	case s.f.ReorderBatches > 0:
		s.f.ReorderBatches--
		a.reorder = true
		a.hold = 200 * time.Millisecond
		if s.f.ReorderHoldMs > 0 {
			a.hold = time.Duration(s.f.ReorderHoldMs) * time.Millisecond
		}
	}
	return a
}

// requestFault reports the status to fail a request with (0: none) and the
// stall to apply.
func (s *faultState) requestFault() (status int, stall time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	stall = time.Duration(s.f.StallMs) * time.Millisecond
	if s.f.FailRequests != 0 {
		if s.f.FailRequests > 0 {
			s.f.FailRequests--
		}
		status = s.f.FailStatus
		if status == 0 {
			status = 500
		}
	}
	return status, stall
}

func (s *faultState) takeReset() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f.ResetRequests != 0 {
		if s.f.ResetRequests > 0 {
			s.f.ResetRequests--
		}
		return true
	}
	return false
}

func (s *faultState) takeCloseMidStream() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.f.CloseMidStream > 0 {
		s.f.CloseMidStream--
		return true
	}
	return false
}

func (s *faultState) healthFail() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.f.HealthFail
}
