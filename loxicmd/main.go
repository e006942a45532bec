// Command loxicmd is the CLI of the load balancer: it creates, lists and
// deletes rules through the daemon's REST API, reads capabilities and KV
// inventories, shows a live view of services (top), and offers offline tools
// (kv tokenize, kv hash) that let an operator compare the gateway's token ids
// and block keys with the engine's.
//
// Exit codes are stable so scripts can branch on them: 0 success, 2 invalid
// command-line input, 3 authentication (401/403), 4 precondition (404, 409,
// 412), 5 daemon unavailable (transport error, 408, 429, 503), 6 request
// rejected as invalid by the daemon (400, 413), 7 any other failure, 8 a
// check of get diagnostics failed, or get cluster found settings that
// differ between nodes.
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/loxilb-llm/loxilb/api/client"
)

// Exit codes.
const (
	exitOK           = 0
	exitUsage        = 2
	exitAuth         = 3
	exitPrecondition = 4
	exitUnavailable  = 5
	exitInvalid      = 6
	exitFailed       = 7
	exitCheckFailed  = 8
)

// usageError marks errors in the command line itself.
type usageError struct{ error }

func usagef(format string, args ...any) error { return usageError{fmt.Errorf(format, args...)} }

func exitCode(err error) int {
	var ue usageError
	var ae *client.APIError
	switch {
	case err == nil:
		return exitOK
	case errors.Is(err, errCheckFailed), errors.Is(err, errDrift):
		return exitCheckFailed
	case errors.As(err, &ue):
		return exitUsage
	case errors.As(err, &ae):
		switch {
		case ae.Status == 401 || ae.Status == 403:
			return exitAuth
		case ae.Status == 404 || ae.Status == 409 || ae.Status == 412:
			return exitPrecondition
		case ae.Status == 408 || ae.Status == 429 || ae.Status == 503:
			return exitUnavailable
		case ae.Status == 400 || ae.Status == 413 || ae.Status == 422:
			return exitInvalid
		}
		return exitFailed
	case errors.Is(err, client.ErrUnavailable):
		return exitUnavailable
	}
	return exitFailed
}

func main() {
	root := newRootCmd(os.Stdout, os.Stderr)
	err := root.Execute()
	if err != nil {
		fmt.Fprintln(os.Stderr, "Error:", err)
	}
	os.Exit(exitCode(err))
}
