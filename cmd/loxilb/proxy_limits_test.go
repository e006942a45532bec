package main

import (
	"io"
	"strings"
	"testing"
	"time"
)

// TestProxyLimitFlags: every proxy limit has a working default, and a
// value that would disable it or could never work stops the daemon with
// an error naming the flag.
func TestProxyLimitFlags(t *testing.T) {
	c, err := parseFlags(nil, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	pc := c.proxyConfig()
	if pc.ResponseHeaderTimeout != 300*time.Second || pc.StreamIdleTimeout != 60*time.Second ||
		pc.MaxResponseHeaderBytes != 1<<20 || pc.MaxInflightBodyBytes != 256<<20 || pc.MaxConnsPerListener != 10000 ||
		pc.AbortOnClientClose {
		t.Errorf("defaults: %+v", pc)
	}
	for _, tc := range []struct {
		args []string
		flag string
	}{
		{[]string{"--proxy-response-header-timeout", "0s"}, "--proxy-response-header-timeout"},
		{[]string{"--proxy-stream-idle-timeout", "-1s"}, "--proxy-stream-idle-timeout"},
		{[]string{"--proxy-max-response-header", "100"}, "--proxy-max-response-header"},
		{[]string{"--proxy-max-inflight-body", "1024"}, "--proxy-max-inflight-body"},
		{[]string{"--proxy-max-body", "0"}, "--proxy-max-body"},
		{[]string{"--proxy-max-conns", "0"}, "--proxy-max-conns"},
	} {
		_, err := parseFlags(tc.args, noEnv, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tc.flag) {
			t.Errorf("%v: err %v, want one naming %s", tc.args, err, tc.flag)
		}
	}
	c, err = parseFlags([]string{"--proxy-max-conns", "5", "--proxy-stream-idle-timeout", "2s", "--proxy-abort-on-client-close"}, noEnv, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if pc := c.proxyConfig(); pc.MaxConnsPerListener != 5 || pc.StreamIdleTimeout != 2*time.Second || !pc.AbortOnClientClose {
		t.Errorf("flags not applied: %+v", pc)
	}
}
