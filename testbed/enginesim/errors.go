package enginesim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
)

// Sentinel errors; the HTTP status of a response is chosen from them by
// statusOf and nowhere else.
var (
	// ErrBadRequest marks a malformed or unsupported request (400).
	ErrBadRequest = errors.New("bad request")
	// ErrModelNotFound marks a request for a model the engine does not serve (404).
	ErrModelNotFound = errors.New("model not found")
	// ErrNoPrefill marks a decode leg whose prefill leg cannot be found or
	// does not match (400).
	ErrNoPrefill = errors.New("no matching prefill")
	// ErrOverloaded marks a request refused because the queue is full (503).
	ErrOverloaded = errors.New("engine overloaded")
	// ErrNotFound marks an unknown sim resource (404).
	ErrNotFound = errors.New("not found")
)

// injectedError carries the status of a fault-injected failure.
type injectedError struct{ status int }

func (e injectedError) Error() string { return "injected fault" }

func statusOf(err error) int {
	var inj injectedError
	switch {
	case errors.As(err, &inj):
		return inj.status
	case errors.Is(err, ErrBadRequest), errors.Is(err, ErrNoPrefill):
		return http.StatusBadRequest
	case errors.Is(err, ErrModelNotFound), errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrOverloaded):
		return http.StatusServiceUnavailable
	default:
		return http.StatusInternalServerError
	}
}

func errorType(status int) string {
	switch {
	case status == http.StatusNotFound:
		return "NotFoundError"
	case status < 500:
		return "BadRequestError"
	default:
		return "InternalServerError"
	}
}

// writeError answers in the engine's error style: vLLM's nested OpenAI
// {"error": {...}}, the flat {"object": "error", ...} of SGLang and
// TensorRT-LLM, and llama.cpp's {"error": {"code", "message", "type"}}.
func writeError(w http.ResponseWriter, engine string, err error) {
	status := statusOf(err)
	msg := err.Error()
	var body any
	switch engine {
	case EngineVLLM:
		body = map[string]any{"error": map[string]any{
			"message": msg, "type": errorType(status), "param": nil, "code": status}}
	case EngineLlamaCpp:
		t := "invalid_request_error"
		if status == http.StatusNotFound {
			t = "not_found_error"
		} else if status >= 500 {
			t = "server_error"
		}
		body = map[string]any{"error": map[string]any{"code": status, "message": msg, "type": t}}
	default:
		body = map[string]any{"object": "error", "message": msg, "type": errorType(status),
			"param": nil, "code": status}
	}
	writeJSON(w, status, body)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// errReset is returned after a request's connection was reset on purpose;
// nothing more can be written.
var errReset = errors.New("connection reset by fault injection")

// resetConn reads the whole request body, then aborts the connection with
// a TCP RST (SO_LINGER 0): the client has sent everything and gets no
// answer.
func resetConn(w *trackingWriter, r *http.Request) error {
	_, _ = io.Copy(io.Discard, r.Body)
	hj, ok := w.ResponseWriter.(http.Hijacker)
	if !ok {
		return errors.New("reset fault: connection cannot be hijacked")
	}
	conn, _, err := hj.Hijack()
	if err != nil {
		return fmt.Errorf("reset fault: %w", err)
	}
	w.written = true
	if tc, ok := conn.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = conn.Close()
	return errReset
}
